"""The `Comm` collectives of the optional modes, apart from the ones every step makes: the
deterministic mode's all-to-all, variable-size gathers (JSON values, the deterministic norm, the
ZeRO-3 parameter gathers) and point-to-point messages (the pipeline's). Like every collective of a
Comm, each is non-blocking for MPI and waited on under the run's deadline (or handed to the caller,
who waits for it through `Comm.wait` or capstone.parallel.progress).
"""

from __future__ import annotations

import numpy as np


class Exchanges:
    """Alltoall, Allgatherv, Iallgatherv, Isend, Irecv and Barrier of a Comm (its `mpi`, `wait`, `hooks`)."""

    def Alltoall(self, send: np.ndarray, recv: np.ndarray, what: str, kind: str = "alltoall") -> None:
        """Block j of `send` to rank j, block i of `recv` from rank i."""
        self.hooks.at(kind)
        self.wait(self.mpi.Ialltoall(send, recv), what, kind, "alltoall", send.nbytes)

    def Allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int], what: str) -> None:
        """Every rank's `send` (counts[r] values from rank r) into `recv`, in rank order."""
        self.wait(self.mpi.Iallgatherv(send, [recv, counts]), what)

    def Iallgatherv(self, send: np.ndarray, recv: np.ndarray, counts: list[int]):
        """Start `Allgatherv`; wait for the request (or hand it to capstone.parallel.progress)."""
        self.hooks.at("allgather_params")
        return self.mpi.Iallgatherv(send, [recv, counts])

    def Isend(self, buf: np.ndarray, dest: int, tag: int):
        """Start sending `buf` to rank `dest` of this group; wait for the request."""
        self.hooks.at("send")
        return self.mpi.Isend(buf, dest=dest, tag=tag)

    def Irecv(self, buf: np.ndarray, source: int, tag: int):
        """Start receiving into `buf` from rank `source` of this group; wait for the request."""
        return self.mpi.Irecv(buf, source=source, tag=tag)

    def Barrier(self, what: str = "barrier") -> None:
        self.wait(self.mpi.Ibarrier(), what)
