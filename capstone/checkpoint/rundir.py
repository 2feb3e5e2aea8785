"""What a run directory holds: one run.

A run has an id (`new_id`, made when it starts fresh) recorded in its lock's owner record, in each
"start" row of its metrics.jsonl and in every checkpoint's metadata (`RunState.run_id`); a resume
keeps it. So `--resume PATH --out OUT` can tell whether PATH's run is the one OUT already holds:
resuming another run's checkpoint into an occupied OUT would mix two runs' checkpoints and metrics
(and `latest` would name the other one), so it is refused with the reason (`foreign`). Checkpoints
written before run ids were recorded count as OUT's own only when they lie inside OUT.

`--resume PATH` without `--out` continues in the run directory PATH belongs to (`run_dir_of`): a run
directory, its checkpoints directory or `latest`, a checkpoint in it or in its `best` directory.
"""

import contextlib
import json
import os
import uuid

import h5py

from capstone.flags import paths
from capstone.checkpoint import CheckpointError, files
from capstone.checkpoint.reader import read_meta

METRICS = "metrics.jsonl"


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def run_dir_of(target: str | None) -> str | None:
    """The run directory `--resume target` belongs to (None: 'latest', 'auto', or not inside one)."""
    what = paths.kind(target) if target and target not in ("latest", "auto") else paths.Kind.MISSING
    if what is paths.Kind.MISSING:
        return None
    found = os.path.abspath(target)
    if what is not paths.Kind.RUN:
        up = found if os.path.isdir(found) else os.path.dirname(found)
        if os.path.basename(up) == "best" and os.path.basename(os.path.dirname(up)) == "checkpoints":
            up = os.path.dirname(up)
        found = os.path.dirname(up) if os.path.basename(up) == "checkpoints" else None
    return found if found is None or os.path.isabs(target) else os.path.relpath(found)


def checkpoint_run_id(path: str) -> str | None:
    """The run id in checkpoint `path`'s metadata (None: not recorded, or unreadable here)."""
    with contextlib.suppress(OSError, CheckpointError), h5py.File(path, "r") as f:
        return (read_meta(f, path).get("run") or {}).get("run_id")
    return None


def occupant(out: str) -> dict | None:
    """Who OUT belongs to: {"run_id": str | None, "holds": what} if it holds checkpoints or metrics
    of a run, else None."""
    complete = files.complete_checkpoints(os.path.join(out, "checkpoints"))
    log = os.path.join(out, METRICS)
    logged = os.path.isfile(log) and os.path.getsize(log) > 0
    if not complete and not logged:
        return None
    run_id = checkpoint_run_id(complete[-1][1]) if complete else None
    holds = " and ".join(["checkpoints"] * bool(complete) + [METRICS] * logged)
    return {"run_id": run_id or (logged_run_id(log) if logged else None), "holds": holds}


def logged_run_id(log: str) -> str | None:
    """The run id of the last "start" row of a metrics.jsonl."""
    found = None
    with open(log, errors="replace") as f:
        for line in f:
            if '"start"' in line:
                with contextlib.suppress(ValueError):
                    found = json.loads(line).get("run_id") or found
    return found


def foreign(want: str, path: str, out: str) -> str | None:
    """Why checkpoint `path` (from `--resume want`) must not be resumed into OUT (None: it may): OUT
    holds another run. Rank 0."""
    if (here := occupant(out)) is None:
        return None
    mine = checkpoint_run_id(path)
    inside = os.path.realpath(path).startswith(os.path.realpath(out) + os.sep)
    if (mine == here["run_id"]) if mine and here["run_id"] else inside:
        return None
    theirs = f"run {mine}" if mine else "a run"
    home = run_dir_of(path)
    return (f"--resume {want}: that checkpoint belongs to {theirs}{f' (in {home})' if home else ''}, but --out {out} "
            f"holds the {here['holds']} of {'run ' + here['run_id'] if here['run_id'] else 'another run'}: "
            f"resuming there would mix two runs' checkpoints and metrics. A run directory holds one run: "
            f"continue that run in its own directory (drop --out{f', it is {home}' if home else ''}), branch it "
            f"off into a new --out, or continue the run of {out} with --resume latest. Nothing was changed.")
