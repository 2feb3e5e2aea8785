"""Which checkpoint a run starts from: `--resume PATH | latest | auto`, decided once on rank 0.

- no --resume: a fresh run, refused if OUT/checkpoints already holds a checkpoint (nothing is
  ever overwritten by accident);
- latest: the checkpoint `latest` names; if there is no pointer (a save was interrupted before
  its first pointer update), the newest complete `ckpt-*.h5` file; an error if there is none;
- auto: like latest, but a fresh start when there is no checkpoint (for batch scripts);
- PATH: that file. Refused if OUT/checkpoints holds newer checkpoints that `latest` acknowledged,
  since this run's saves would replace them: branch off with a new --out instead.
A complete file newer than `latest` is the leftover of a save killed before its pointer update;
the resumed run writes that step again.
"""

from __future__ import annotations

import os

from .checkpoint import files
from .config import ConfigError


def _plan(want: str | None, ckpt_dir: str) -> dict:
    """Rank 0: {"path": str | None} or {"error": message}; reads the file system only."""
    for d in (os.path.dirname(ckpt_dir), ckpt_dir):
        if os.path.exists(d) and not os.path.isdir(d):
            return {"error": f"{d} exists and is not a directory; pass a directory (new or a run's) as --out."}
    complete = files.complete_checkpoints(ckpt_dir)
    if not want:
        if complete:
            return {"error": f"{ckpt_dir} already holds checkpoints of an earlier run; continue it with --resume "
                             f"latest, or pass a new --out directory for a fresh run (nothing was changed)."}
        return {"path": None}
    try:
        pointed = files.read_pointer(ckpt_dir)
    except ValueError as exc:
        return {"error": str(exc)}
    if want in ("latest", "auto"):
        if pointed is not None and not os.path.isfile(pointed):
            return {"error": f"{ckpt_dir}/latest names {os.path.basename(pointed)}, which is missing; pass "
                             f"--resume with one of the files there: {[os.path.basename(p) for _, p in complete]}"}
        path = pointed or (complete[-1][1] if complete else None)
        if path is None and want == "latest":
            return {"error": f"--resume latest: no complete checkpoint in {ckpt_dir}. Pass the run's --out "
                             f"directory, a ckpt-*.h5 path, or --resume auto to start fresh when there is none."}
        return {"path": path}
    step = _step_of(want)
    acknowledged = _step_of(pointed) if pointed else -1
    newer = [os.path.basename(p) for s, p in complete if step < s <= acknowledged]
    if newer:
        return {"error": f"--resume {want} (step {step}) into --out {os.path.dirname(ckpt_dir)}, which holds newer "
                         f"checkpoints {newer}: this run would replace them. Pass a new --out directory to branch "
                         f"off from step {step}, or --resume latest to continue the newest one."}
    return {"path": want}


def _step_of(path: str) -> int:
    m = files.NAME_RE.match(os.path.basename(path))
    return int(m.group(1)) if m else 0


def resolve(dist, want: str | None, ckpt_dir: str) -> str | None:
    """Collective: call on all ranks. The checkpoint to resume from (None: fresh start); creates
    the checkpoint directory once the decision is made; raises ConfigError on every rank."""
    plan = dist.bcast_json(_plan(want, ckpt_dir) if dist.rank == 0 else None)
    if "error" in plan:
        raise ConfigError(plan["error"])
    if dist.rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    return plan["path"]
