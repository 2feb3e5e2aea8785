"""No collective waits forever: non-blocking MPI requests waited on with a deadline.

Every collective of the training path is issued non-blocking (Ireduce_scatter, Iallreduce,
Iallgather(v), Ibcast, Ibarrier, ...) and handed to `Deadline.wait`, which polls
`MPI.Request.Testall` (spinning, with sched_yield, for the first SPIN_DEDICATED_S when every rank
has a core, SPIN_S when ranks share cores, then sleeping with a backoff capped at MAX_SLEEP_S).
If the requests are not complete after `seconds`, this rank
prints ONE line (which collective, which step, how long it waited, what to do) and calls
`comm.Abort(1)`: the whole job ends with a non-zero exit instead of hanging on a dead or
unreachable peer. The checkpoint on disk stays the last complete one: a save publishes only after
barriers every rank passed (capstone.checkpoint.save), so an abort in the middle never publishes.

The timeout: `--collective-timeout SECONDS` if given (> 0); otherwise automatic,
max(FLOOR_S, STEP_MULT x the longest step this rank has measured so far) -- generous on purpose:
a slow shared filesystem during a checkpoint or a loaded node must not kill a healthy job.
Only mpi4py-using modules (dist, zero, checkpoint) import this; the training loop does not.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from mpi4py import MPI

FLOOR_S = 300.0      # the automatic timeout is never below this
STEP_MULT = 20.0     # ... nor below this many times the longest step measured so far
SPIN_S = 0.002       # poll without sleeping for this long when ranks share cores (oversubscribed)
SPIN_DEDICATED_S = 0.05   # ... and when each rank has a core: sleeping there only adds latency
#                     (2 ranks on 2 cores, shakespeare-char: 44-45 ms per step against 50-51 ms)
MAX_SLEEP_S = 0.001  # then sleep between polls, doubling from 20 us up to this


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
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    return local <= (os.cpu_count() or 1)


class Deadline:
    """The timeout of this rank's collectives, and the step they belong to (for the message)."""

    def __init__(self, comm, seconds: float = 0.0):
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.explicit = float(seconds)   # > 0: --collective-timeout; 0: automatic
        self.step: int | None = None     # the step being run (None: start-up or the end of the run)
        self.longest_step = 0.0          # seconds, between consecutive begin_step calls
        self._step_start: float | None = None
        self.record: str | None = None   # where expire() writes what timed out (JSON), if set
        self.spin_s = SPIN_DEDICATED_S if dedicated_cores(comm) else SPIN_S

    def set_timeout(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"the collective timeout must be >= 0 (0: automatic), got {seconds}")
        self.explicit = float(seconds)

    def record_to(self, path: str) -> None:
        """On expiry, also write what timed out to `path` (the run directory's
        collective-timeout.json): scripts/slurm/step.sh reads it to stop a lingering mpirun and requeue."""
        self.record = path

    @property
    def seconds(self) -> float:
        """The explicit timeout from the first step on; before it (start-up: rank 0 may be reading
        and verifying a large checkpoint while the others wait) at least FLOOR_S."""
        auto = max(FLOOR_S, STEP_MULT * self.longest_step)
        if self.explicit > 0:
            return self.explicit if self.step is not None else max(self.explicit, FLOOR_S)
        return auto

    def begin_step(self, step: int) -> None:
        """The training loop starts step `step`; the time since the previous one is a step's time."""
        now = time.monotonic()
        if self._step_start is not None:
            self.longest_step = max(self.longest_step, now - self._step_start)
        self._step_start, self.step = now, step

    def wait(self, requests, what: str) -> None:
        """Wait until every request in `requests` is complete, or abort the job at the deadline."""
        if not isinstance(requests, (list, tuple)):
            requests = [requests]
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

    def expire(self, what: str, waited: float) -> None:
        """Print the one line and end the whole job (every rank) with exit code 1."""
        at = f"step {self.step}" if self.step is not None else "start-up/shutdown (no step running)"
        how = f"--collective-timeout {self.explicit:g}" if self.explicit > 0 else \
            f"automatic timeout {self.seconds:.0f} s = max({FLOOR_S:.0f} s, {STEP_MULT:g} x longest step)"
        print(f"[rank {self.rank}/{self.world}] capstone: collective timeout: {what} at {at} did not complete "
              f"after {waited:.1f} s ({how}); a peer rank is probably dead or unreachable: check its host and "
              f"the network, then rerun with --resume auto (the last complete checkpoint is intact). "
              f"Aborting the job.", file=sys.stderr, flush=True)
        sys.stdout.flush()
        self._write_record(what, at, waited)
        self.comm.Abort(1)

    def _write_record(self, what: str, at: str, waited: float) -> None:
        """Best effort (the run directory may be unwritable or gone): the abort must happen anyway."""
        if self.record is None:
            return
        tmp = f"{self.record}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({"rank": self.rank, "world": self.world, "host": socket.gethostname(), "pid": os.getpid(),
                           "collective": what, "at": at, "waited_s": round(waited, 1), "time": time.time()}, f)
            os.replace(tmp, self.record)
        except OSError:
            pass
