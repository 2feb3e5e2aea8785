"""`Comm`: a group of ranks through which every collective of a run goes.

How it works: docs/design.md, "Inside the step", collective/comm.py."""

import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from capstone.collective.deadline import Deadline, guard
from capstone.step.hooks import NONE


@dataclass
class Traffic:
    """One kind of collective in a step: nccl-tests' op name, group size, S bytes summed, seconds waited, calls."""

    op: str
    ranks: int
    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    hidden: float = 0.0   # seconds it ran behind compute (a prefetch), besides the `seconds` waited for it


class Comm:
    """Rank, size and deadline-bound collectives of one MPI communicator."""

    def __init__(self, mpi_comm, deadline: Deadline | None = None, traffic: dict | None = None, hooks=NONE):
        self.mpi = mpi_comm                  # for h5py's mpio driver only (see `blocking`)
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.deadline = deadline if deadline is not None else Deadline(mpi_comm)
        self.traffic = {} if traffic is None else traffic   # kind -> Traffic, shared by a grid's comms
        self.hooks = hooks                   # each kind of collective is a hook point (capstone.step.hooks)

    def derived(self, mpi_comm) -> "Comm":
        """Another group of this run's ranks: the same deadline, traffic count and hooks."""
        return Comm(mpi_comm, self.deadline, self.traffic, self.hooks)

    def begin_step(self, step: int) -> None:
        """Name the step in timeout messages, time it for the automatic deadline, reset the traffic."""
        self.deadline.begin_step(step)
        self.traffic.clear()

    def step_traffic(self) -> dict:
        """A copy of the collectives counted since `begin_step`, by kind (of every Comm of the grid)."""
        return {kind: dataclasses.replace(t) for kind, t in self.traffic.items()}

    def wait(self, requests, what: str, kind: str | None = None, op: str = "", nbytes: int = 0) -> None:
        """Wait for `requests` under the deadline; count them and the wait under `kind` (None: not counted)."""
        requests = requests if isinstance(requests, list) else [requests]
        t0 = time.perf_counter()
        self.deadline.wait(requests, what)
        if kind is not None:
            self.count(kind, op or kind, nbytes, time.perf_counter() - t0, len(requests))

    def _run(self, start, what: str, kind: str | None, op: str, nbytes: int) -> None:
        """The hook point `kind` (or `op`), then `start()`'s request waited for and counted as `wait` does."""
        self.wait(self._started(kind or op, start), what, kind, op, nbytes)

    def _started(self, point: str, start):
        """The hook point `point`, then `start()`'s request, not waited for."""
        self.hooks.at(point)
        return start()

    def count(self, kind: str, op: str, nbytes: int, seconds: float, calls: int = 1, hidden: float = 0.0) -> None:
        t = self.traffic.setdefault(kind, Traffic(op, self.size))
        t.bytes, t.seconds, t.calls, t.hidden = t.bytes + nbytes, t.seconds + seconds, t.calls + calls, t.hidden + hidden

    def Allreduce(self, buf: np.ndarray, what: str, kind: str = "allreduce") -> np.ndarray:
        """Sum `buf` over the group, in place."""
        if self.size > 1:
            self._run(lambda: self.mpi.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM), what, kind, "allreduce", buf.nbytes)
        return buf

    def Allgather(self, buf: np.ndarray, what: str, kind: str | None = None, send: np.ndarray | None = None) -> None:
        """Rank r's block r of `buf` (its len(buf)/size values, or `send`) to every rank, in place."""
        if self.size > 1 or send is not None:
            self._run(lambda: self.mpi.Iallgather(MPI.IN_PLACE if send is None else send, buf), what, kind, "allgather",
                      buf.nbytes)

    def Bcast(self, buf: np.ndarray, what: str, root: int = 0, kind: str | None = None) -> None:
        if self.size > 1:
            self._run(lambda: self.mpi.Ibcast(buf, root=root), what, kind, "broadcast", buf.nbytes)

    def Ireduce_scatter(self, send: np.ndarray, recv: np.ndarray, counts: list[int]):
        """Start summing `send` over the group into rank r's counts[r] values of `recv`; `wait` (or `Test`) it."""
        self.hooks.at("reduce_scatter")
        return self.mpi.Ireduce_scatter(send, recv, counts, op=MPI.SUM)

    def Iallreduce(self, buf: np.ndarray):
        """Start summing `buf` over the group in place; `wait` for the request (or `Test` it)."""
        return self._started("allreduce", lambda: self.mpi.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))

    def sum(self, values, what: str = "allreduce (sums)", kind: str | None = None) -> list[float]:
        """Element-wise sums (float64) of a few numbers over the group."""
        v = np.array(values, dtype=np.float64)
        self._run(lambda: self.mpi.Iallreduce(MPI.IN_PLACE, v, op=MPI.SUM), what, kind, "allreduce", v.nbytes)
        return [float(x) for x in v]

    def Alltoall(self, send: np.ndarray, recv: np.ndarray, what: str, kind: str = "alltoall") -> None:
        """Block j of `send` to rank j, block i of `recv` from rank i."""
        self._run(lambda: self.mpi.Ialltoall(send, recv), what, kind, "alltoall", send.nbytes)

    def Alltoallv(self, send: np.ndarray, send_spec: tuple, recv: np.ndarray, recv_spec: tuple, what: str) -> None:
        """`Alltoall` with a spec (counts, displacements) per side, in elements."""
        self._run(lambda: self.mpi.Ialltoallv([send, send_spec], [recv, recv_spec]), what, "alltoall", "alltoallv",
                  sum(send_spec[0]) * send.itemsize)

    def Ialltoallv(self, send: np.ndarray, send_spec: tuple, recv: np.ndarray, recv_spec: tuple):
        """Start `Alltoallv` (a gradient's pieces: the reduce-scatter's hook point); wait for the request."""
        return self._started("reduce_scatter", lambda: self.mpi.Ialltoallv([send, send_spec], [recv, recv_spec]))

    def Iallgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]):
        """Start gathering every rank's `send` (counts[r] values from rank r) into `recv`, in rank order; wait for the
        request (or hand it to capstone.parallel.progress)."""
        return self._started("allgather_params", lambda: self.mpi.Iallgatherv(send, [recv, counts]))

    def Isend(self, buf: np.ndarray, dest: int, tag: int):
        """Start sending `buf` to rank `dest` of this group; wait for the request."""
        return self._started("send", lambda: self.mpi.Isend(buf, dest=dest, tag=tag))

    def Irecv(self, buf: np.ndarray, source: int, tag: int):
        """Start receiving into `buf` from rank `source` of this group; wait for the request."""
        return self.mpi.Irecv(buf, source=source, tag=tag)

    def Barrier(self, what: str = "barrier") -> None:
        self.wait(self.mpi.Ibarrier(), what)

    def allgather_json(self, value) -> list:
        """Every rank's JSON-able value, in rank order, on every rank."""
        data, sizes, buf = self._encoded(value)
        self.wait(self.mpi.Iallgatherv(data, [buf, sizes]), "allgather (JSON)")
        return _split_json(buf, sizes)

    def gather_json(self, value, root: int = 0) -> list | None:
        """Every rank's JSON-able value on `root`, None elsewhere."""
        data, sizes, buf = self._encoded(value)
        self.wait(self.mpi.Igatherv(data, [buf, sizes] if self.rank == root else None, root=root), "gather (JSON)")
        return _split_json(buf, sizes) if self.rank == root else None

    def _encoded(self, value) -> tuple[np.ndarray, list[int], np.ndarray]:
        """`value` as JSON bytes, every rank's count of them, and a buffer for all ranks' bytes."""
        data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
        out, mine = np.empty(self.size, dtype=np.int64), np.array([len(data)], dtype=np.int64)
        self.wait(self.mpi.Iallgather(mine, out), "allgather (JSON sizes)")
        return data, [int(x) for x in out], np.empty(int(out.sum()), dtype=np.uint8)

    def bcast_json(self, value, root: int = 0):
        """Root's JSON-able value on every rank."""
        data = json.dumps(value).encode() if self.rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        self.wait(self.mpi.Ibcast(n, root=root), "broadcast (JSON size)")
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(n[0]), np.uint8)
        self.wait(self.mpi.Ibcast(buf, root=root), "broadcast (JSON)")
        return json.loads(buf.tobytes())

    @contextmanager
    def blocking(self, what: str):
        """A blocking collective call (h5py's mpio driver on `self.mpi`) bounded by the deadline."""
        self.hooks.at("blocking")
        with guard(self.deadline, what):
            yield self.mpi

    def split(self, color: int, key: int, what: str) -> "Comm":
        """The ranks of equal `color`, ordered by `key`, as a Comm sharing this one's deadline."""
        with self.blocking(f"communicator split ({what})"):
            return self.derived(self.mpi.Split(color, key))

    def for_thread(self, what: str) -> "Comm | None":
        """This group again for another thread's collectives (own deadline; no hooks); None without THREAD_MULTIPLE."""
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return None
        dup, request = self.mpi.Idup()
        self.wait(request, f"communicator duplicate ({what})")
        return Comm(dup, Deadline(dup, self.deadline.explicit, self.deadline.spin_s))

    def node_size(self) -> int:
        """How many ranks of this group share this rank's node."""
        with self.blocking("split by node"):
            node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED)
        size = node.Get_size()
        node.Free()
        return size

    def abort(self, code: int = 1) -> None:
        """End the whole job now (every rank), e.g. after an exception on one rank."""
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)


def _split_json(buf: np.ndarray, sizes: list[int]) -> list:
    return [json.loads(buf[end - n:end].tobytes()) for n, end in zip(sizes, np.cumsum(sizes))]
