"""A signal's stop saves without a held-out evaluation (`save_on_stop`; "judged": false in the
file's metadata when the guard had not judged the state), and that file is judged before anything
trains from it.

A resume evaluates the loaded state on the held-out set and asks the guard the question of an
evaluation step (`Guard.update_verdict`: every rank's state finite, the held-out loss not above
spike_factor x the last judged one). Kept: the run goes on from it, judged. Rejected: a file of
this run's directory is set aside as `ckpt-*.h5.rejected-<token>` (never deleted, never resumed)
and `latest` names the newest older checkpoint, which the run falls back to (judged in turn if it
needs to be); with none, the resume stops (exit 1) and says how to start over.
"""

import os

from capstone.checkpoint import files
from capstone.checkpoint.files import CheckpointError
from capstone.collective.agree import agreed


def verdict(run, meta: dict) -> tuple[str | None, float | None]:
    """Collective. (None, held-out loss or None) if the state just loaded may be trained from, else
    (the guard's reason, the held-out loss). A kept state counts as judged from here on."""
    if meta.get("judged", True):
        return None, None
    held, finite = run.heldout.after_update(run.opt.finite(), True)
    if (reason := run.guard.update_verdict(held, finite)) is None:
        run.guard.state.last_eval, run.guard.state.pending = held, False
    return reason, held


def fall_back(run, path: str, reason: str, held: float) -> str:
    """Collective. `path` failed its judgement: set it aside (if it is this run's) and return the newest
    older checkpoint in its directory, after one warning line; CheckpointError on every rank if none."""
    last = run.guard.state.last_eval
    why = (f"{path} was saved by a stop before the guard judged it, and fails that judgement now: {reason} "
           f"(held-out loss {held:.5g}, the last judged one {last if last is None else f'{last:.5g}'})")

    def decide() -> str:
        memory = not isinstance(path, str)   # a state of the memory tier (capstone.checkpoint.recover.Found)
        folder, step = (run.ckpt.directory, path.step + 1) if memory else (os.path.dirname(path), files.step_of(path))
        mine = not memory and os.path.abspath(folder) == os.path.abspath(run.ckpt.directory)
        try:
            older = [p for s, p in files.complete_checkpoints(folder) if s < step]
            aside = f"; set aside as {os.path.basename(files.quarantine(path, 'rejected'))}" if mine else ""
            if mine and older:
                files.write_pointer(folder, os.path.basename(older[-1]))
        except OSError as exc:   # e.g. no permission to set the file aside
            raise CheckpointError(f"{why}; it could not be set aside ({exc}): fix the permissions of "
                                  f"{folder} and rerun.") from None
        if not older:
            raise CheckpointError(f"{why}{aside}. {folder} holds no older checkpoint to fall back to: start the "
                                  f"run again (a new --out, or --resume auto in {run.out}, which starts it over).")
        print(f"warning: {why}{aside}; resuming from {os.path.basename(older[-1])}, the newest older checkpoint"
              f"{f' ({folder}/latest now names it)' if mine else ''}.", flush=True)
        return older[-1]
    return agreed(run.grid.world, decide, errors=(CheckpointError,))


def save_on_stop(run, abandoned: int) -> None:
    """Collective. A signal's stop at step `abandoned`, before its update: the state is the previous
    step's. It is saved without a held-out evaluation (the slow part of a stop), marked judged only if
    the guard had judged it; a resume judges it first (capstone.checkpoint.judge). A resumed run
    stopped before its first update saves nothing: the checkpoint it resumed from holds that state."""
    run.state.step = abandoned - 1
    if not run.ckpt.holds(run.resumed_from, run.state.step):
        man = run.ckpt.save(run.state, run.opt.state, judged=not run.guard.state.pending)
        run.metrics.write({"event": "stop", "abandoned_step": abandoned, "saved_step": run.state.step,
                           "judged": man["judged"], "path": man["path"]})
