"""How a run's launch ended, on record whatever ended it.

The ranks write OUT/summary.json as a run ends (capstone.observe.outcome): completed, preempted,
failed, diverged, timeout. When they cannot (a lost rank or host, a SIGKILL, mpirun ending them),
whoever outlives them writes it: the job around the step (capstone.runtime.job: scripts/launch and
the batch scripts) as soon as the step has ended, or else the next start in that directory
(capstone.run). Such a record says `"status": "ended without a record"`, who noticed, the
launch's exit status if known, the newest checkpoint (`checkpoints/latest`), and the status the
directory's summary.json said before, if any. A refused start (exit 2) writes nothing: it left
nothing behind.
"""

import contextlib
import json
import os
import pathlib
import time

from capstone.observe.jsonout import write_json

UNRECORDED = "ended without a record"


def status(run_dir: str) -> str | None:
    """summary.json's status (None: none, or unreadable)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads(pathlib.Path(run_dir, "summary.json").read_text()).get("status")
    return None


def _written_since(run_dir: str, since: float) -> bool:
    with contextlib.suppress(OSError):
        return os.stat(os.path.join(run_dir, "summary.json")).st_mtime >= since - 1
    return False


def newest_checkpoint(run_dir: str) -> str | None:
    with contextlib.suppress(OSError):
        return os.path.join(run_dir, "checkpoints", pathlib.Path(run_dir, "checkpoints", "latest").read_text().strip())
    return None


def record(run_dir: str, who: str, exit_status: int | None, note: str) -> str:
    """Write the record of a launch that ended without the ranks' own; returns its one-line account."""
    newest = newest_checkpoint(run_dir)
    write_json(os.path.join(run_dir, "summary.json"),   # its previous status read before it is replaced
               {"status": UNRECORDED, "recorded_by": who, "exit_status": exit_status, "newest_checkpoint": newest,
                "previous_status": status(run_dir), "time": time.time(), "note": note})
    return (f"the launch ended without the ranks' record ({note}); {who} wrote summary.json; its newest "
            f"checkpoint is {newest or 'none'}")


def settle(run_dir: str, since: float, exit_status: int, who: str) -> str | None:
    """After a launch that started at `since` ended with `exit_status`: summary.json's status, written by
    the ranks, or (they wrote none, and the start was not refused) the record written now."""
    trained = os.path.exists(os.path.join(run_dir, "metrics.jsonl"))   # else it never started training here
    if _written_since(run_dir, since) or exit_status in (0, 2) or not trained:
        return status(run_dir)
    print(record(run_dir, who, exit_status, f"exit status {exit_status}"), flush=True)
    return UNRECORDED


def previous(run_dir: str) -> str | None:
    """At a start (rank 0, the run directory locked): if the last launch here began training and left
    no record of how it ended (summary.json older than its start row in metrics.jsonl), the record,
    written now, and what to say; else None."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            starts = [line for line in f if '"event": "start"' in line]
        started = float(json.loads(starts[-1])["time"])
    except (OSError, IndexError, TypeError, ValueError, KeyError):
        return None
    if _written_since(run_dir, started + 1):
        return None
    return "note: " + record(run_dir, "the next start", None, "found at the next start in this directory")
