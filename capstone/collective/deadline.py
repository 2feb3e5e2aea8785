"""No collective waits forever: a deadline on non-blocking requests, a watchdog on blocking calls
(docs/design.md, "Inside the step", collective/deadline.py)."""

import contextlib
import os
import socket
import sys
import time

from mpi4py import MPI

from capstone.collective.watchdog import Watchdog, write_record

FLOOR_S = 300.0      # the automatic timeout is never below this
STEP_MULT = 20.0     # ... nor below this many times the longest step measured so far
SPIN_S = 0.002       # poll without sleeping for this long when ranks share cores (oversubscribed)
SPIN_DEDICATED_S = 0.05   # ... and when each rank has a core: sleeping there only adds latency
MAX_SLEEP_S = 0.001  # then sleep between polls, doubling from 20 us up to this


def floor_s() -> float:
    return float(os.environ.get("CAPSTONE_DEADLINE_FLOOR_S", FLOOR_S))


class Deadline:
    """The timeout of this rank's collectives, and the step they belong to (for the message)."""

    def __init__(self, comm, seconds: float = 0.0, spin_s: float = SPIN_DEDICATED_S):
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.explicit = float(seconds)   # > 0: --collective-timeout; 0: automatic
        self.step: int | None = None     # the step being run (None: start-up or the end of the run)
        self.longest_step = 0.0          # seconds, between consecutive begin_step calls
        self._step_start: float | None = None
        self.record: str | None = None   # where a timeout is recorded (JSON: scripts/slurm/step.sh reads it), if set
        self.spin_s = spin_s             # how long a wait spins before it sleeps (see dedicated_cores)
        self.watchdog = Watchdog()       # the watchdog process, started on its first use (`guard`)
        self.on_expire = None            # what else a timeout does (summary.json: capstone.observe.outcome.recorded)

    def set_timeout(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the collective timeout must be >= 0 (0: automatic), got {seconds}")
        self.explicit = float(seconds)

    def record_to(self, path: str) -> None:
        self.record = path

    @property
    def seconds(self) -> float:
        """The explicit timeout from the first step on, at least the floor before it; else automatic."""
        if self.explicit > 0:
            return self.explicit if self.step is not None else max(self.explicit, floor_s())
        return max(floor_s(), STEP_MULT * self.longest_step)

    def describe(self) -> str:
        if self.explicit > 0 and self.step is not None:
            return f"--collective-timeout {self.explicit:g}"
        if self.explicit > 0:
            return f"start-up timeout {self.seconds:g} s = max(--collective-timeout {self.explicit:g}, floor {floor_s():g} s)"
        return f"automatic timeout {self.seconds:.0f} s = max({floor_s():g} s, {STEP_MULT:g} x longest step)"

    def begin_step(self, step: int) -> None:
        """The training loop starts step `step`; the time since the previous one is a step's time."""
        now = time.monotonic()
        if self._step_start is not None:
            self.longest_step = max(self.longest_step, now - self._step_start)
        self._step_start, self.step = now, step

    def wait(self, requests: list, what: str) -> None:
        """Wait until every request is complete, or end the job at the deadline."""
        t0, limit, sleep = time.monotonic(), self.seconds, 2e-5
        while not MPI.Request.Testall(requests):
            if (now := time.monotonic()) < t0 + self.spin_s:
                os.sched_yield()   # a pure spin on a dedicated core; lets a peer run on a shared one
            else:
                if now - t0 >= limit:
                    expire(self, what, now - t0)
                time.sleep(sleep)
                sleep = min(2 * sleep, MAX_SLEEP_S)


def message(deadline, what: str, waited: float | None = None) -> tuple[str, dict]:
    """The one line of a timeout of `what`, and its record."""
    at = f"step {deadline.step}" if deadline.step is not None else "start-up/shutdown (no step running)"
    waited = deadline.seconds if waited is None else waited
    line = (f"[rank {deadline.rank}/{deadline.world}] capstone: collective timeout: {what} at {at} did not "
            f"complete after {waited:.1f} s ({deadline.describe()}); a peer rank is probably dead or "
            f"unreachable: check its host and the network, then rerun with --resume auto (the last complete "
            f"checkpoint is intact). Aborting the job.")
    return line, {"rank": deadline.rank, "world": deadline.world, "host": socket.gethostname(), "pid": os.getpid(),
                  "collective": what, "at": at, "waited_s": round(waited, 1), "time": time.time()}


def expire(deadline, what: str, waited: float) -> None:
    """Print the one line, record it and end the whole job (every rank) with exit code 1."""
    line, record = message(deadline, what, waited)
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    write_record(deadline.record, record)
    if deadline.on_expire is not None:
        with contextlib.suppress(Exception):   # best effort: the abort must happen anyway
            deadline.on_expire(record)
    MPI.COMM_WORLD.Abort(1)


@contextlib.contextmanager
def guard(deadline, what: str):
    """Run the block under this rank's watchdog: at the deadline it prints the timeout line and kills this rank."""
    line, record = message(deadline, what)
    deadline.watchdog.send({"arm": deadline.seconds, "line": line, "record": deadline.record, "data": record})
    try:
        yield
    finally:
        deadline.watchdog.send({"disarm": True})
