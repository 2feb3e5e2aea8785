"""The gradient reduce-scatter in buckets, overlapped with the backward pass (like PyTorch DDP), and its plan.

How it works: docs/design.md, "Inside the step", parallel/buckets.py."""

import bisect

import numpy as np

from capstone.model.params import Layout
from capstone.parallel.reduce import Flags, GradReducer, GradStats


def tree_order(world: int) -> list[int]:
    """order[j] = the rank at position j of the reduce-scatter's communicator: bit-reversed for a
    power-of-2 world (an involution), else the identity (why: docs/design.md, "The bucketed reduce-scatter")."""
    bits = world.bit_length() - 1
    if world < 4 or world != 1 << bits:
        return list(range(world))
    return [int(format(j, f"0{bits}b")[::-1], 2) for j in range(world)]


class GroupPlan:
    """Where a range [a, b) of the flat buffer (a bucket of whole `params`, a parameter group) goes in a
    reduce-scatter: its counts in the rank order `order` (None: the identity), this rank's piece's place."""

    def __init__(self, a: int, b: int, layout: Layout, rank: int, order: list[int] | None = None, params=()):
        self.a, self.b, self.params = a, b, params
        order = order or list(range(layout.world))
        pieces = [(max(a, lo), min(b, hi)) for lo, hi in map(layout.shard_range, range(layout.world))]
        self.counts = [max(0, pieces[o][1] - pieces[o][0]) for o in order]   # by position in the order
        lo, n = layout.shard_range(rank)[0], max(0, pieces[rank][1] - pieces[rank][0])
        self.recv = slice(max(a, lo) - lo, max(a, lo) - lo + n)               # within g_shard
        # with a non-identity order the pieces are staged in that order: (staging slice, grads slice)
        self.copies, pos = [], a
        for o, n_o in zip(order, self.counts):
            if n_o:
                self.copies.append((slice(pos, pos + n_o), slice(pieces[o][0], pieces[o][0] + n_o)))
                pos += n_o


def plan(layout: Layout, bucket_floats: int, rank: int = 0, order: list[int] | None = None) -> list[GroupPlan]:
    """Buckets in flat order (bucket 0 starts at 0), filled from the end: whole parameters, each at least
    `bucket_floats` long except bucket 0 (the remainder). The padding goes with the last parameter."""
    entries, bounds, end, params = sorted(layout.entries, key=lambda e: e[2]), [], layout.padded, []
    for i in range(len(entries) - 1, -1, -1):
        params.append(i)
        start = entries[i][2]
        if end - start >= bucket_floats or i == 0:
            bounds.append((0 if i == 0 else start, end, sorted(params)))
            end, params = start, []
    return [GroupPlan(a, b, layout, rank, order, p) for a, b, p in reversed(bounds)]


class BucketReducer(GradReducer):
    """Sum `grads` over dp into `grad_shard`, bucket by bucket (`bucket_floats` >= the buffer: one, after backward)."""

    # tree: sums in recursive-halving order (a power-of-2 world); op: the collective; wire: bytes a value on the
    # wire (capstone.parallel.bf16sum: 2)
    tree, op, wire = True, "reduce_scatter", 4

    def __init__(self, grid, layout: Layout, grads, bucket_floats: int, loss_weight: float = 1.0):
        super().__init__(grid, layout, grads, loss_weight)
        dp, rank = grid.dp, grid.dp.rank
        self.order = tree_order(dp.size) if self.tree else list(range(dp.size))
        identity = self.order == sorted(self.order)
        self.comm = dp if identity else dp.split(0, self.order[rank], "reduce-scatter in tree order")
        self.staging = None if identity else np.empty_like(grads)
        self.buckets = plan(layout, max(1, int(bucket_floats)), rank, self.order)
        self.base, self.itemsize = grads.__array_interface__["data"][0], grads.itemsize
        self.offsets = sorted(off for _, _, off in layout.entries)   # a sink covers whole params
        self.bucket_of = [k for k, bucket in enumerate(self.buckets) for _ in bucket.params]   # params run in order
        self.micro_batches, self.watching, self.overlapped = 1, False, 0   # overlapped: started in the last backward
        self._reset()

    def _reset(self) -> None:
        self.seen, self.missing = [0] * len(self.bucket_of), [len(b.params) for b in self.buckets]
        # next: the bucket to start (they start highest first); requests[:tested] have completed
        self.next, self.requests, self.tested = len(self.buckets) - 1, [], 0

    def start(self, micro_batches: int) -> None:
        """Before a step's micro-batches: start buckets from the backward pass as they become ready (if several)."""
        self._reset()
        self.micro_batches, self.overlapped, self.watching = int(micro_batches), 0, len(self.buckets) > 1

    def landed(self, name: str, sink: np.ndarray) -> None:
        """The gradients in `sink` (group `name`'s slice of the buffer) are final for this micro-batch."""
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
        while self.tested < len(self.requests) and self.requests[self.tested].Test():   # drive the outstanding ones
            self.tested += 1

    def _start(self, k: int) -> None:
        self.requests.append(self._request(self.buckets[k]))
        self.next = k - 1

    def _request(self, b: GroupPlan):
        """Bucket b's non-blocking reduce-scatter (its pieces staged first in a non-identity order)."""
        if self.staging is None:
            return self.comm.Ireduce_scatter(self.grads[b.a:b.b], self.grad_shard[b.recv], b.counts)
        for dst, src in b.copies:
            self.staging[dst] = self.grads[src]
        return self.comm.Ireduce_scatter(self.staging[b.a:b.b], self.grad_shard[b.recv], b.counts)

    def finish(self, losses: list[float], flags: Flags) -> GradStats:
        """Start what is left (bucket 0, any the backward did not complete), wait for all, then the small allreduce."""
        self.watching = False
        while self.next >= 0:
            self._start(self.next)
        n = len(self.buckets)
        what = f"{self.op.replace('_', '-')} of the gradient" + (
            f" ({n} buckets, {self.overlapped} started during backward)" if n > 1 else "")
        self.comm.wait(self.requests, what, self.op, self.op, self.grads.size * self.wire)
        self._reset()
        return self.stats(sum(losses), flags)

    def nbytes(self) -> int:
        return self.grad_shard.nbytes + (0 if self.staging is None else self.staging.nbytes)

    def bound(self, micro_batches: int) -> int:
        """The formula for `nbytes`: the receive shard, and a staging copy when the sums run in tree order."""
        return 4 * self.layout.shard + (0 if self.staging is None else 4 * self.layout.padded)
