"""How a run ended, in summary.json: the held-out losses (start, final, best and its step), and the
summary of a run that ended before its invariants could be checked (the divergence guard's abort,
a collective timeout), so that summary.json always says how a run ended.
"""

import contextlib
import dataclasses
import os
import time

from capstone.checkpoint import CheckpointError, best, files
from capstone.step.guard import DivergenceError
from capstone.observe.jsonout import write_json
from capstone.observe.runlog import logged_rows

STOPPING = "stopping"   # a stop's checkpoint is saved, its end-of-run checks not yet run (`stopped`)


def held_out(run) -> dict:
    """The held-out losses: at the start, the final one (the current accepted state's, with the step
    of this segment's last evaluation), the best one with its step (None: the start) and, with
    --keep-best, the checkpoint that holds it."""
    state = run.state
    steps = [step for step, _, held in state.losses if held is not None]
    kept = files.read_pointer(os.path.join(run.ckpt.directory, best.DIRECTORY)) if run.tcfg.keep_best else None
    return {"start": state.eval_start, "final": state.guard.last_eval, "final_step": steps[-1] if steps else None,
            "best": state.best_eval, "best_step": state.best_step, "best_checkpoint": kept}


@contextlib.contextmanager
def recorded(run, start_step: int, started: float, log):
    """Around the training loop: a DivergenceError (raised on every rank together) writes summary.json
    with status "diverged" (rank 0) before it propagates; a collective timeout makes the rank whose
    wait expired write status "timeout" (best effort: the job is being aborted; any rank may, since
    every rank holds the same record of the run, and the file is replaced atomically). Any other exception
    first waits for the checkpoint being written in the background (the other ranks' writers finish it
    with this one), so a crash in a step keeps the checkpoint a synchronous save would have kept."""
    path, deadline = os.path.join(run.out, "summary.json"), run.grid.world.deadline
    deadline.on_expire = lambda record: write_json(path, ended(run, "timeout", record["collective"], start_step,
                                                               started, {"timeout": record}))
    try:
        yield
    except DivergenceError as exc:
        log.close()
        with contextlib.suppress(CheckpointError):   # the divergence is the run's error: a failed write only follows it
            run.ckpt.drain()
        if run.grid.world.rank == 0:
            write_json(path, ended(run, "diverged", str(exc), start_step, started))
        run.metrics.close()
        raise
    except Exception:   # a crash (an exception on this rank): the checkpoint being written is finished first
        with contextlib.suppress(CheckpointError):
            run.ckpt.drain()
        raise
    finally:
        deadline.on_expire = None


def basics(run, status: str, start_step: int, wall: float) -> dict:
    """What summary.json says of every run, however it ended: the status, the run's configs, grid and
    provenance, its losses, checkpoints and rollbacks, the held-out losses and the wall time."""
    return {"status": status, "world_size": run.grid.world.size, "grid": run.grid.describe(),
            "model_config": dataclasses.asdict(run.mcfg), "train_config": dataclasses.asdict(run.tcfg),
            "n_params": run.n_params, "start_step": start_step, "final_step": run.state.step,
            "resumed_from": run.resumed_from, "losses": [list(x) for x in run.state.losses],
            "checkpoints": run.ckpt.manifests, "rollbacks": run.state.rollbacks, "wall_seconds": wall,
            "provenance": run.ckpt.provenance, "held_out": held_out(run)}


def ended(run, status: str, reason: str, start_step: int, started: float, extra: dict | None = None) -> dict:
    """summary.json of a run that ended with `status` ("diverged", "timeout") before finishing: what
    it did up to there (`last_step`: the newest row of metrics.jsonl, None: none yet) and why it stopped;
    no invariant was checked."""
    rows = logged_rows(os.path.join(run.out, "metrics.jsonl"))
    return {**basics(run, status, start_step, time.perf_counter() - started), "reason": reason,
            "last_step": rows[-1] if rows else None, "invariants": None, **(extra or {})}


def stopped(run, step: int, why: str | None) -> None:
    """Rank 0, once a stop's checkpoint is published: summary.json says so at once (status STOPPING at `step`,
    the newest checkpoint), in case mpirun's kill sequence ends the ranks before their checks and full summary
    ("preempted", which replaces this one) are done: a reader that finds STOPPING after the run has ended
    knows the checkpoint was saved and the checks never ran."""
    newest = None
    with contextlib.suppress(ValueError):
        newest = files.read_pointer(run.ckpt.directory)
    write_json(os.path.join(run.out, "summary.json"),
               {"status": STOPPING, "final_step": step, "reason": why, "newest_checkpoint": newest,
                "provisional": "the run's own summary replaces this once its checks have run", "time": time.time()})
