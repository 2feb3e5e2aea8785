"""The gradient reduce-scatter in buckets, overlapped with the backward pass (like PyTorch DDP).

How it works: docs/design.md, "Inside the step", parallel/buckets.py.
"""

from __future__ import annotations

import bisect
import collections

import numpy as np

from capstone.model.params import Layout
from capstone.parallel.bucket_plan import plan, tree_order
from capstone.parallel.reduce import Flags, GradReducer, GradStats


class BucketReducer(GradReducer):
    """Sum `grads` over the data-parallel group into `grad_shard`, bucket by bucket (see the
    module). `bucket_floats` >= the buffer: one bucket, started after the backward pass."""

    tree, op = True, "reduce_scatter"     # sums in recursive-halving order (a power-of-2 world); the collective

    def __init__(self, grid, layout: Layout, grads, bucket_floats: int, loss_weight: float = 1.0):
        super().__init__(grid, layout, grads, loss_weight)
        dp, rank = grid.dp, grid.dp.rank
        self.order = tree_order(dp.size) if self.tree else list(range(dp.size))
        if self.order == sorted(self.order):
            self.comm, self.staging = dp, None
        else:
            self.comm, self.staging = dp.split(0, self.order[rank], "reduce-scatter in tree order"), \
                np.empty_like(grads)
        self.buckets = plan(layout, max(1, int(bucket_floats)), rank, self.order)
        entries = sorted(layout.entries, key=lambda e: e[2])
        self.base, self.itemsize = grads.__array_interface__["data"][0], grads.itemsize
        self.offsets = [off for _, _, off in entries]   # a sink covers whole params
        self.bucket_of = [0] * len(entries)
        for k, bucket in enumerate(self.buckets):
            for i in bucket.params:
                self.bucket_of[i] = k
        self.micro_batches, self.watching = 1, False
        self._reset()
        self.overlapped = 0   # buckets started from inside the backward pass, last step

    def _reset(self) -> None:
        self.seen = [0] * len(self.bucket_of)
        self.missing = [len(b.params) for b in self.buckets]
        self.next = len(self.buckets) - 1        # the next bucket to start (they start highest first)
        self.pending: collections.deque = collections.deque()
        self.requests: list = []

    def start(self, micro_batches: int) -> None:
        """Before a step's forward+backward of `micro_batches` micro-batches: start buckets from the
        backward pass as they become ready (when there is more than one)."""
        self._reset()
        self.micro_batches, self.overlapped = int(micro_batches), 0
        self.watching = len(self.buckets) > 1

    def landed(self, name: str, sink: np.ndarray) -> None:
        """The gradients of the parameters in `sink` (group `name`'s slice of the buffer) are final
        for this micro-batch."""
        if not self.watching:
            return
        start = (sink.__array_interface__["data"][0] - self.base) // self.itemsize
        for i in range(bisect.bisect_left(self.offsets, start), bisect.bisect_left(self.offsets, start + sink.size)):
            self.seen[i] += 1
            if self.seen[i] == self.micro_batches:
                self.missing[self.bucket_of[i]] -= 1
        while self.next > 0 and self.missing[self.next] == 0:
            self._start(self.next)
            self.overlapped += 1
        while self.pending and self.pending[0].Test():   # drive the outstanding collectives
            self.pending.popleft()

    def _start(self, k: int) -> None:
        b = self.buckets[k]
        if self.staging is None:
            send = self.grads[b.a:b.b]
        else:
            for dst, src in b.copies:
                self.staging[dst] = self.grads[src]
            send = self.staging[b.a:b.b]
        req = self.comm.Ireduce_scatter(send, self.grad_shard[b.recv], b.counts)
        self.requests.append(req)
        self.pending.append(req)
        self.next = k - 1

    def finish(self, losses: list[float], flags: Flags) -> GradStats:
        """Start what is left (bucket 0, and any bucket the backward pass did not complete), wait
        for every bucket with the deadline, then the step's small allreduce."""
        self.watching = False
        while self.next >= 0:
            self._start(self.next)
        what = f"{self.op.replace('_', '-')} of the gradient" + (f" ({len(self.buckets)} buckets, {self.overlapped} started "
                                                   f"during backward)" if len(self.buckets) > 1 else "")
        self.comm.wait(self.requests, what, self.op, self.op, self.grads.nbytes)
        self._reset()
        return self.stats(sum(losses), flags)

    def nbytes(self) -> int:
        return self.grad_shard.nbytes + (0 if self.staging is None else self.staging.nbytes)

    def bound(self, micro_batches: int) -> int:
        """The formula for `nbytes`: the receive shard, and a staging copy when the sums run in tree order."""
        return 4 * self.layout.shard + (0 if self.staging is None else 4 * self.layout.padded)
