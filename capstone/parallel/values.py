"""Small values (Python objects as JSON, never pickle) over a group of ranks: the `Comm` methods for
agreement and reports (which checkpoint to resume, errors every rank must raise, memory rows,
provenance), each a pair of uint8 buffer collectives waited on under the deadline.
"""

from __future__ import annotations

import json

import numpy as np


class JsonValues:
    """allgather_json, gather_json and bcast_json of a Comm (its `mpi`, `wait`, `rank`, `size`)."""

    def allgather_json(self, value) -> list:
        """Every rank's JSON-able value, in rank order, on every rank."""
        data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
        sizes = self._sizes(len(data))
        buf = np.empty(sum(sizes), dtype=np.uint8)
        self.Allgatherv(data, buf, sizes, "allgather (JSON)")
        return _split_json(buf, sizes)

    def gather_json(self, value, root: int = 0) -> list | None:
        """Every rank's JSON-able value on `root`, None elsewhere."""
        data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
        sizes = self._sizes(len(data))
        buf = np.empty(sum(sizes), dtype=np.uint8) if self.rank == root else None
        self.wait(self.mpi.Igatherv(data, [buf, sizes] if self.rank == root else None, root=root), "gather (JSON)")
        return _split_json(buf, sizes) if self.rank == root else None

    def _sizes(self, n: int) -> list[int]:
        out, mine = np.empty(self.size, dtype=np.int64), np.array([n], dtype=np.int64)
        self.wait(self.mpi.Iallgather(mine, out), "allgather (JSON sizes)")
        return [int(x) for x in out]

    def bcast_json(self, value, root: int = 0):
        """Root's JSON-able value on every rank."""
        data = json.dumps(value).encode() if self.rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        self.wait(self.mpi.Ibcast(n, root=root), "broadcast (JSON size)")
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(n[0]), np.uint8)
        self.wait(self.mpi.Ibcast(buf, root=root), "broadcast (JSON)")
        return json.loads(buf.tobytes())


def _split_json(buf: np.ndarray, sizes: list[int]) -> list:
    out, pos = [], 0
    for n in sizes:
        out.append(json.loads(buf[pos:pos + n].tobytes()))
        pos += n
    return out
