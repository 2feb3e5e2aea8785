"""What happens when a collective does not complete in time (capstone.parallel.deadline).

`expire`: this rank prints ONE line (which collective, which step, how long it waited, what to
do), writes it to the run directory's collective-timeout.json (the batch scripts' watchdog reads
it), calls the deadline's `on_expire` if the run set one (its summary.json) and ends the whole job.
`guard(deadline, what)` covers a call MPI or HDF5 offers only blocking (a communicator `Split`, a
collective parallel-HDF5 open, write or close): this rank's watchdog
process (capstone.parallel.watchdog) prints the same line at the deadline and kills this rank,
which ends the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

from mpi4py import MPI

from capstone.parallel.watchdog import Watchdog


def message(deadline, what: str, waited: float | None = None) -> tuple[str, dict]:
    """The one line of a timeout of `what`, and its record."""
    at = f"step {deadline.step}" if deadline.step is not None else "start-up/shutdown (no step running)"
    how = deadline.describe()
    waited = deadline.seconds if waited is None else waited
    line = (f"[rank {deadline.rank}/{deadline.world}] capstone: collective timeout: {what} at {at} did not "
            f"complete after {waited:.1f} s ({how}); a peer rank is probably dead or unreachable: check its host "
            f"and the network, then rerun with --resume auto (the last complete checkpoint is intact). "
            f"Aborting the job.")
    record = {"rank": deadline.rank, "world": deadline.world, "host": socket.gethostname(), "pid": os.getpid(),
              "collective": what, "at": at, "waited_s": round(waited, 1), "time": time.time()}
    return line, record


def expire(deadline, what: str, waited: float) -> None:
    """Print the one line, record it and end the whole job (every rank) with exit code 1."""
    line, record = message(deadline, what, waited)
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    if deadline.record is not None:
        write_record(deadline.record, record)
    if getattr(deadline, "on_expire", None) is not None:   # summary.json (capstone.observe.outcome.recorded)
        try:
            deadline.on_expire(record)
        except Exception:   # noqa: BLE001 - best effort: the abort must happen anyway
            pass
    MPI.COMM_WORLD.Abort(1)


@contextlib.contextmanager
def guard(deadline, what: str):
    """Run the block under this rank's watchdog: at the deadline it prints the timeout line and
    kills this rank (the job then ends), even if the block holds the GIL inside MPI or HDF5."""
    line, record = message(deadline, what)
    if deadline.watchdog is None:
        deadline.watchdog = Watchdog()
    deadline.watchdog.arm(deadline.seconds, line, deadline.record, record)
    try:
        yield
    finally:
        deadline.watchdog.disarm()


def write_record(path: str, record: dict) -> None:
    """Best effort (the run directory may be unwritable or gone): the abort must happen anyway."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass
