"""Which checkpoint a run starts from: `--resume PATH | latest | auto`, decided once on rank 0.

- no --resume: a fresh run, refused if OUT/checkpoints already holds a checkpoint, or OUT an
  earlier run's metrics.jsonl (nothing is ever overwritten or appended to by accident);
- latest: the checkpoint `latest` names; if there is no pointer (a save was interrupted before
  its first pointer update), the newest complete `ckpt-*.h5` file; an error if there is none, or
  if its bytes do not match its digest file (the error names it and suggests auto);
- auto (batch scripts, requeues): a fresh start when there is no checkpoint; else the newest one
  that verifies (rank 0 checks the bytes against the digest file and every shard's sha256): the
  one `latest` names, else each older one in turn. Each corrupt one passed over is set aside as
  `ckpt-*.h5.corrupt-<token>` (never deleted), `latest` moves to the one chosen, and one warning
  line says so. When none verifies, or one is refused for a reason a person must settle (no
  digest file, another format version), it stops with an error and changes nothing;
- PATH: that file, or the checkpoint a run directory or `latest` pointer names. Refused if
  OUT/checkpoints holds newer checkpoints that `latest` acknowledged, since this run's saves
  would replace them: branch off with a new --out instead; and refused if OUT holds another run
  (capstone.checkpoint.rundir: a run directory holds one run).
A complete file newer than `latest` is the leftover of a save killed before its pointer update;
the resumed run writes that step again. Partial files a killed save left are removed once the plan
is made (one note says so). A checkpoint a stop saved before the guard judged it is judged when
it is loaded (capstone.checkpoint.judge).
"""

import os
import sys

from capstone.checkpoint import CheckpointError, CorruptCheckpoint, files, integrity, rundir, serial, verify_contents
from capstone.collective.agree import agreed
from capstone.config import ConfigError


def _plan(want: str | None, ckpt_dir: str) -> dict:
    """Rank 0: {"path": str | None, "warning"?: str} or {"error": message, "invalid"?: True (exit 1)}."""
    for d in (os.path.dirname(ckpt_dir), ckpt_dir):
        if os.path.exists(d) and not os.path.isdir(d):
            return {"error": f"{d} exists and is not a directory; pass a directory (new or a run's) as --out."}
    complete = files.complete_checkpoints(ckpt_dir)
    if not want:
        if complete:
            return {"error": f"{ckpt_dir} already holds checkpoints of an earlier run; continue it with --resume "
                             f"latest, or pass a new --out directory for a fresh run (nothing was changed)."}
        return _fresh(os.path.dirname(ckpt_dir))
    try:
        pointed = files.read_pointer(ckpt_dir)
    except ValueError as exc:
        return {"error": str(exc)}
    if want in ("auto", "latest"):
        return (_auto if want == "auto" else _latest)(ckpt_dir, pointed, complete)
    return _explicit(want, ckpt_dir, pointed, complete)


def _fresh(out: str) -> dict:
    """A fresh run (no --resume) is refused in a directory holding an earlier run's metrics.jsonl: its
    steps would be appended to that run's log. (--resume auto starting over keeps appending: a requeued
    job's launches share one log, each opened by its "start" row, repeated steps flagged.)"""
    log = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(log) and os.path.getsize(log) > 0:
        return {"error": f"{out} holds {os.path.basename(log)} of an earlier run, without a checkpoint to continue "
                         f"from: a fresh run would append to that log. Pass a new --out for a fresh run, or move "
                         f"{log} (and summary.json) away first; --resume auto starts that run over in the same log. "
                         f"Nothing was changed."}
    return {"path": None}


def _latest(ckpt_dir: str, pointed: str | None, complete: list) -> dict:
    if pointed is not None and not os.path.isfile(pointed):
        return {"error": f"{ckpt_dir}/latest names {os.path.basename(pointed)}, which is missing; pass "
                         f"--resume with one of the files there: {[os.path.basename(p) for _, p in complete]}, "
                         f"or --resume auto to take the newest one that verifies."}
    path = pointed or (complete[-1][1] if complete else None)
    if path is None:
        return {"error": f"--resume latest: no complete checkpoint in {ckpt_dir}. Pass the run's --out "
                         f"directory, a ckpt-*.h5 path, or --resume auto to start fresh when there is none."}
    if found := integrity.problem(path):
        return {"error": f"--resume latest: {integrity.message(path, *found)}", "invalid": True}
    return {"path": path}


def _auto(ckpt_dir: str, pointed: str | None, complete: list) -> dict:
    newest = pointed or (complete[-1][1] if complete else None)
    if newest is None:
        return {"path": None}
    bad = []
    for path in [newest] + [p for s, p in reversed(complete) if s < files.step_of(newest)]:
        try:
            if os.path.exists(path):
                verify_contents(path)
                return _fall_back(ckpt_dir, path, bad)
            reason = "it does not exist"
        except CorruptCheckpoint as exc:
            reason = exc.reason
        except CheckpointError as exc:
            return {"error": f"--resume auto: {exc}", "invalid": True}
        bad.append((path, reason))
    listed = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in bad)
    return {"error": f"--resume auto: no checkpoint in {ckpt_dir} verifies ({listed}). Nothing was changed: "
                     f"restore a good copy, or pass a new --out for a fresh run.", "invalid": True}


def _fall_back(ckpt_dir: str, path: str, bad: list) -> dict:
    """Set the corrupt checkpoints newer than `path` aside, point `latest` at `path`, say so."""
    if not bad:
        return {"path": path}
    moved = [(p, files.quarantine(p) if os.path.exists(p) else None, r) for p, r in bad]
    files.write_pointer(ckpt_dir, os.path.basename(path))
    aside = "; ".join(f"set aside {os.path.basename(p)} as {os.path.basename(m)} ({r})" if m else
                      f"{os.path.basename(p)} is missing" for p, m, r in moved)
    return {"path": path, "warning": f"warning: --resume auto: {aside}; resuming from {os.path.basename(path)}, "
                                     f"the newest checkpoint that verifies ({ckpt_dir}/latest now names it)."}


def _explicit(want: str, ckpt_dir: str, pointed: str | None, complete: list) -> dict:
    try:
        path = serial.find(want, "--resume")   # ConfigError for a path that is no run directory or checkpoint
    except CheckpointError as exc:
        return {"error": f"--resume {want}: {exc}"}
    if not os.path.exists(path):   # a `latest` that names a file no longer there
        return {"error": f"--resume {want}: {path}, which its {files.POINTER} names, does not exist. Pass one of "
                         f"the ckpt-*.h5 files beside it, or --resume auto to take the newest one that verifies."}
    step = files.step_of(path)
    if newer := [os.path.basename(p) for s, p in complete if step < s <= (files.step_of(pointed) if pointed else -1)]:
        return {"error": f"--resume {want} (step {step}) into --out {os.path.dirname(ckpt_dir)}, which holds newer "
                         f"checkpoints {newer}: this run would replace them. Pass a new --out directory to branch "
                         f"off from step {step}, or --resume latest to continue the newest one."}
    other = rundir.foreign(want, path, os.path.dirname(ckpt_dir))
    return {"error": other} if other else {"path": path}


def _decided(want: str | None, ckpt_dir: str) -> dict:
    """Rank 0: `_plan`'s plan, or its error raised (CheckpointError for an invalid checkpoint)."""
    try:
        if "error" in (plan := _plan(want, ckpt_dir)):
            raise (CheckpointError if plan.get("invalid") else ConfigError)(plan["error"])
        plan["leftovers"] = files.set_aside_leftovers(ckpt_dir)   # a killed save's partial file: never a checkpoint
    except OSError as exc:  # e.g. no permission to set a corrupt file aside
        raise ConfigError(f"--resume {want}: {exc}; fix the permissions of {ckpt_dir} and rerun.") from exc
    return plan


def resolve(comm, want: str | None, ckpt_dir: str) -> str | None:
    """Collective: call on all ranks. The checkpoint to resume from (None: fresh start); creates
    the checkpoint directory once the decision is made. Raises on every rank: CheckpointError
    when a checkpoint is not valid, ConfigError otherwise."""
    plan = agreed(comm, lambda: _decided(want, ckpt_dir), errors=(ConfigError, CheckpointError))
    if comm.rank == 0:
        if plan.get("warning"):
            print(plan["warning"], file=sys.stderr, flush=True)
        if plan.get("leftovers"):
            print(f"note: removed {', '.join(plan['leftovers'])} from {ckpt_dir}: what a killed save left (a partial "
                  f"file is never a checkpoint)", flush=True)
        os.makedirs(ckpt_dir, exist_ok=True)
    comm.Barrier()
    return plan["path"]
