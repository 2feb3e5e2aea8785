"""`--keep-best`: a checkpoint of every new best held-out loss, kept apart from the rotation.

It goes to OUT/checkpoints/best/ckpt-<step>.h5, written and published like every checkpoint (one
parallel-HDF5 file, its digest file, the atomic `best/latest` pointer), then the older best is
removed: the directory holds the best state so far. Resume and --keep-last look only at the files
directly in OUT/checkpoints, so the best one is never resumed or rotated by accident;
`python -m capstone.checkpoint verify OUT/checkpoints/best` and `python -m capstone.sample
OUT/checkpoints/best` read it. A best state is always an accepted one (the guard judged the update
first), and it is measured on evaluation steps only.
"""

import os

DIRECTORY = "best"


def improved(state, step: int, eval_loss: float | None) -> bool:
    """Whether step `step` set a new best held-out loss (RunState records it when it accepts one)."""
    return eval_loss is not None and state.best_step == step


def keep(run, r) -> None:
    """Collective. With --keep-best, checkpoint step result `r` if it set a new best (an event says so): into
    OUT/checkpoints/best through the run's Checkpointer, keeping only it."""
    if run.tcfg.keep_best and improved(run.state, r.step, r.eval_loss):
        man = run.ckpt.save_best(run.state, run.opt.state, os.path.join(run.ckpt.directory, DIRECTORY))
        r.events.append({"event": "best", "path": man["path"]})
