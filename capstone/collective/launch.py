"""Where a run's communicators start: the job's world (and whether its ranks have a core each, which
sets how long a wait spins), a serial one for a single process, and fail-fast error handling.
"""

import os
import sys
import traceback
from contextlib import contextmanager

from mpi4py import MPI

from capstone.collective.comm import Comm
from capstone.collective.deadline import SPIN_S


def dedicated_cores(world: int, node_size=None) -> bool:
    """Whether every rank of this node has a core to itself: Open MPI's own verdict when mpirun
    started us (OMPI_MCA_mpi_oversubscribe), else the ranks on this node (`node_size()`, a
    collective) against its CPUs."""
    if os.environ.get("OMPI_MCA_mpi_yield_when_idle", "").lower() in ("1", "true"):   # asked to yield
        return False
    if (flag := os.environ.get("OMPI_MCA_mpi_oversubscribe")) is not None:
        return flag == "0"
    return world == 1 or node_size is None or node_size() <= (os.cpu_count() or 1)


def world() -> Comm:
    """The job's ranks (MPI.COMM_WORLD); its waits spin long only when every rank has a core."""
    job = Comm(MPI.COMM_WORLD)
    if not dedicated_cores(job.size, job.node_size):
        job.deadline.spin_s = SPIN_S
    return job


def serial() -> Comm:
    """This rank alone (MPI.COMM_SELF): the serial run, the sampler, the tests' single process."""
    return Comm(MPI.COMM_SELF)


@contextmanager
def fail_fast(comm: Comm):
    """Run a block so that an exception on one rank prints it with the rank and aborts every rank,
    instead of leaving the others blocked in their next collective. SystemExit passes through:
    it is raised on every rank together (agreed failures), so no one is left waiting."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any escape must end the job
        detail = "".join(traceback.format_exception(exc)) if os.environ.get("CAPSTONE_TRACEBACK") else ""
        print(f"[rank {comm.rank}/{comm.size}] error: {type(exc).__name__}: {exc}\n{detail}"
              f"[rank {comm.rank}] aborting all ranks (set CAPSTONE_TRACEBACK=1 for the traceback)",
              file=sys.stderr, flush=True)
        comm.abort(1)
