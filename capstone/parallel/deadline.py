"""No collective waits forever: non-blocking requests waited on with a deadline, and a watchdog
for the calls MPI and HDF5 offer only blocking.

`Deadline.wait` polls `MPI.Request.Testall` (spinning, with sched_yield, for the first
SPIN_DEDICATED_S when every rank has a core, SPIN_S when ranks share cores, then sleeping with a
backoff capped at MAX_SLEEP_S). If the requests are not complete after `seconds`, this rank prints
ONE line (which collective, which step, how long it waited, what to do), writes it to the run
directory's collective-timeout.json (for the batch scripts' watchdog) and ends the whole job.

`Deadline.guard(what)` covers a blocking call (a communicator `Split`, a collective parallel-HDF5
open, write or close): a watchdog process of this rank's (started on first use, it exits with its
parent) prints the same line at the deadline and kills this rank, which ends the job. A thread
would not do: h5py holds the GIL while HDF5 waits in MPI-IO, so no Python thread could run.

The timeout: `--collective-timeout SECONDS` if given (> 0); otherwise automatic,
max(FLOOR_S, STEP_MULT x the longest step this rank has measured so far) -- generous on purpose:
a slow shared filesystem during a checkpoint or a loaded node must not kill a healthy job. Before
the first step (start-up: rank 0 may be reading and verifying a large checkpoint while the others
wait) it is at least the floor. CAPSTONE_DEADLINE_FLOOR_S overrides the floor (tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

from mpi4py import MPI

FLOOR_S = 300.0      # the automatic timeout is never below this
STEP_MULT = 20.0     # ... nor below this many times the longest step measured so far
SPIN_S = 0.002       # poll without sleeping for this long when ranks share cores (oversubscribed)
SPIN_DEDICATED_S = 0.05   # ... and when each rank has a core: sleeping there only adds latency
MAX_SLEEP_S = 0.001  # then sleep between polls, doubling from 20 us up to this
WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")


def floor_s() -> float:
    return float(os.environ.get("CAPSTONE_DEADLINE_FLOOR_S", FLOOR_S))


def dedicated_cores(comm) -> bool:
    """Whether every rank of this node has a core to itself: Open MPI's own verdict when mpirun
    started us (OMPI_MCA_mpi_oversubscribe), else the ranks on this node (collective) against its CPUs."""
    if os.environ.get("OMPI_MCA_mpi_yield_when_idle", "").lower() in ("1", "true"):   # asked to yield
        return False
    flag = os.environ.get("OMPI_MCA_mpi_oversubscribe")
    if flag is not None:
        return flag == "0"
    if comm.Get_size() == 1:
        return True
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)   # start-up, before any deadline exists
    local = node.Get_size()
    node.Free()
    return local <= (os.cpu_count() or 1)


class Deadline:
    """The timeout of this rank's collectives, and the step they belong to (for the message)."""

    def __init__(self, comm, seconds: float = 0.0):
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.explicit = float(seconds)   # > 0: --collective-timeout; 0: automatic
        self.step: int | None = None     # the step being run (None: start-up or the end of the run)
        self.longest_step = 0.0          # seconds, between consecutive begin_step calls
        self._step_start: float | None = None
        self.record: str | None = None   # where a timeout is recorded (JSON), if set
        self.spin_s = SPIN_DEDICATED_S if dedicated_cores(comm) else SPIN_S
        self._watchdog: subprocess.Popen | None = None

    def set_timeout(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the collective timeout must be >= 0 (0: automatic), got {seconds}")
        self.explicit = float(seconds)

    def record_to(self, path: str) -> None:
        """On expiry, also write what timed out to `path` (scripts/slurm/step.sh reads it)."""
        self.record = path

    @property
    def seconds(self) -> float:
        """The explicit timeout from the first step on, at least the floor before it; else automatic."""
        if self.explicit > 0:
            return self.explicit if self.step is not None else max(self.explicit, floor_s())
        return max(floor_s(), STEP_MULT * self.longest_step)

    def begin_step(self, step: int) -> None:
        """The training loop starts step `step`; the time since the previous one is a step's time."""
        now = time.monotonic()
        if self._step_start is not None:
            self.longest_step = max(self.longest_step, now - self._step_start)
        self._step_start, self.step = now, step

    def wait(self, requests: list, what: str) -> None:
        """Wait until every request is complete, or end the job at the deadline."""
        if MPI.Request.Testall(requests):
            return
        t0 = time.monotonic()
        limit = self.seconds
        spin_until, sleep = t0 + self.spin_s, 2e-5
        while True:
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()   # a pure spin on a dedicated core; lets a peer run on a shared one
            else:
                if now - t0 >= limit:
                    self.expire(what, now - t0)
                time.sleep(sleep)
                sleep = min(2 * sleep, MAX_SLEEP_S)
            if MPI.Request.Testall(requests):
                return

    def message(self, what: str, waited: float | None = None) -> tuple[str, dict]:
        """The one line of a timeout of `what`, and its record."""
        at = f"step {self.step}" if self.step is not None else "start-up/shutdown (no step running)"
        how = f"--collective-timeout {self.explicit:g}" if self.explicit > 0 and self.step is not None else \
            f"automatic timeout {self.seconds:.0f} s = max({floor_s():.0f} s, {STEP_MULT:g} x longest step)"
        waited = self.seconds if waited is None else waited
        line = (f"[rank {self.rank}/{self.world}] capstone: collective timeout: {what} at {at} did not complete "
                f"after {waited:.1f} s ({how}); a peer rank is probably dead or unreachable: check its host and "
                f"the network, then rerun with --resume auto (the last complete checkpoint is intact). "
                f"Aborting the job.")
        record = {"rank": self.rank, "world": self.world, "host": socket.gethostname(), "pid": os.getpid(),
                  "collective": what, "at": at, "waited_s": round(waited, 1), "time": time.time()}
        return line, record

    def expire(self, what: str, waited: float) -> None:
        """Print the one line, record it and end the whole job (every rank) with exit code 1."""
        line, record = self.message(what, waited)
        print(line, file=sys.stderr, flush=True)
        sys.stdout.flush()
        if self.record is not None:
            write_record(self.record, record)
        MPI.COMM_WORLD.Abort(1)

    @contextlib.contextmanager
    def guard(self, what: str):
        """Run the block under the watchdog: at the deadline it prints the timeout line and kills
        this rank (the job then ends), even if the block holds the GIL inside MPI or HDF5."""
        line, record = self.message(what)
        self._send({"arm": self.seconds, "line": line, "record": self.record, "data": record})
        try:
            yield
        finally:
            self._send({"disarm": True})

    def _send(self, order: dict) -> None:
        if self._watchdog is None:
            self._watchdog = subprocess.Popen([sys.executable, "-I", "-S", WATCHDOG, str(os.getpid())],
                                              stdin=subprocess.PIPE, close_fds=True)
        self._watchdog.stdin.write(json.dumps(order).encode() + b"\n")
        self._watchdog.stdin.flush()


def write_record(path: str, record: dict) -> None:
    """Best effort (the run directory may be unwritable or gone): the abort must happen anyway."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass
