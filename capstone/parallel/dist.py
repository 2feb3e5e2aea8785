"""The process group: MPI start-up, fail-fast error handling and the few small collectives the
training loop needs (agreement checks, gathering report rows). The loop sees only this interface.

Every collective here is non-blocking and waited on with `self.deadline` (capstone.deadline): a
dead or unreachable peer ends the job with one clear line instead of a hang."""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from capstone.parallel.deadline import Deadline


class Dist:
    """Rank, world size and small collectives over an MPI communicator (COMM_SELF is serial)."""

    def __init__(self, comm=None, timeout: float = 0.0):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        self.deadline = Deadline(self.comm, timeout)   # shared with ZeroAdam (run.build)

    def _wait(self, request, what: str) -> None:
        self.deadline.wait(request, what)

    def allgather_json(self, value):
        """Collective: call on all ranks. List of every rank's JSON-able value (no pickle)."""
        data = json.dumps(value).encode()
        sizes = self._allgather_int(len(data))
        buf = np.empty(sum(sizes), dtype=np.uint8)
        mine = np.frombuffer(data, dtype=np.uint8)
        self._wait(self.comm.Iallgatherv(mine, [buf, sizes]), "allgather (JSON)")
        return _split_json(buf, sizes)

    def gather_json(self, value, root: int = 0):
        """Collective: call on all ranks. List of every rank's JSON-able value on `root`, None elsewhere."""
        data = json.dumps(value).encode()
        sizes = self._allgather_int(len(data))
        buf = np.empty(sum(sizes), dtype=np.uint8) if self.rank == root else None
        mine = np.frombuffer(data, dtype=np.uint8)
        self._wait(self.comm.Igatherv(mine, [buf, sizes] if self.rank == root else None, root=root), "gather (JSON)")
        return _split_json(buf, sizes) if self.rank == root else None

    def _allgather_int(self, n: int) -> list[int]:
        out = np.empty(self.world, dtype=np.int64)
        mine = np.array([n], dtype=np.int64)   # (kept alive until the request completes)
        self._wait(self.comm.Iallgather(mine, out), "allgather (JSON sizes)")
        return [int(x) for x in out]

    def bcast_json(self, value, root: int = 0):
        """Collective: call on all ranks. Root's JSON-able value on every rank (no pickle)."""
        data = json.dumps(value).encode() if self.rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        self._wait(self.comm.Ibcast(n, root=root), "broadcast (JSON size)")
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(n[0]), dtype=np.uint8)
        self._wait(self.comm.Ibcast(buf, root=root), "broadcast (JSON)")
        return json.loads(buf.tobytes())

    def allreduce_sum(self, values) -> list[float]:
        """Collective: call on all ranks. Element-wise sums (float64) of a few numbers."""
        v = np.array(values, dtype=np.float64)
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, v, op=MPI.SUM), "allreduce (sums)")
        return [float(x) for x in v]

    def local_size(self) -> int:
        """Collective: call on all ranks. How many ranks share this rank's node."""
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_size()
        finally:
            node.Free()

    def barrier(self) -> None:
        """Collective: call on all ranks."""
        self._wait(self.comm.Ibarrier(), "barrier")

    def abort(self, code: int = 1) -> None:
        """End the whole job now (every rank), e.g. after an exception on one rank."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)


def _split_json(buf: np.ndarray, sizes: list[int]) -> list:
    """Decode the concatenated JSON documents of a gather (one per rank, `sizes` bytes each)."""
    out, pos = [], 0
    for n in sizes:
        out.append(json.loads(buf[pos:pos + n].tobytes()))
        pos += n
    return out


@contextmanager
def fail_fast(dist: Dist):
    """Run a block so that an exception on one rank prints it with the rank and aborts every rank,
    instead of leaving the others blocked in their next collective. SystemExit passes through:
    it is raised on every rank together (agreed failures), so no one is left waiting."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any escape must end the job
        detail = "".join(traceback.format_exception(exc)) if os.environ.get("CAPSTONE_TRACEBACK") else ""
        print(f"[rank {dist.rank}/{dist.world}] error: {type(exc).__name__}: {exc}\n{detail}"
              f"[rank {dist.rank}] aborting all ranks (set CAPSTONE_TRACEBACK=1 for the traceback)",
              file=sys.stderr, flush=True)
        dist.abort(1)
