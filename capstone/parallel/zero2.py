"""ZeRO-2: the gradient is sharded too. No flat gradient buffer: each parameter group's gradient
goes, as the backward pass makes it, into a non-blocking reduce-scatter over the data-parallel
group, which sums it into this rank's shard (`grad_shard`); the gradient is freed when it is done.

A group (the embedding, a block, the head) is a contiguous range [a, b) of the flat layout; rank r
receives its overlap with [r*shard, (r+1)*shard), as the buckets of capstone.parallel.buckets do.
Groups smaller than --bucket-mb are staged together, in the order the backward pass makes them,
until their bucket is at least that long (DeepSpeed's reduce bucket); a larger group goes alone.
One reduction is in flight while the backward pass makes the next bucket (double buffering),
progressed by capstone.parallel.progress's thread: a rank holds its shard and at most two buckets
(`bound`), not the whole gradient. With gradient accumulation every micro-batch is
reduced on its own: the first is received straight into the shard, the later ones into small
temporaries added to it (so each element is the sum over micro-batches of the sums over ranks:
the same numbers as ZeRO-1 summing micro-batches first, to float32 rounding).
"""

import numpy as np

from capstone.model.params import DTYPE, Layout
from capstone.parallel.bf16sum import Pieces
from capstone.parallel.buckets import GroupPlan
from capstone.parallel.progress import Progress
from capstone.parallel.reduce import Flags, GradReducer, GradStats


class GroupBucket(GroupPlan):
    """Consecutive groups reduced together: their range's plan, names, and the staging buffer filling up."""

    def __init__(self, names: list[str], ranges: dict, layout: Layout, rank: int):
        super().__init__(min(ranges[n][0] for n in names), max(ranges[n][1] for n in names), layout, rank)
        self.names, self.ranges, self.staging, self.arrived = names, ranges, None, 0

    def add(self, name: str, g: np.ndarray):
        """Stage group `name`'s gradient; returns the bucket's whole gradient once every group is in."""
        if len(self.names) == 1:
            return g.reshape(-1)
        if self.staging is None:
            self.staging = np.empty(self.b - self.a, dtype=DTYPE)
        a, b = self.ranges[name]
        self.staging[a - self.a:b - self.a] = g.reshape(-1)
        self.arrived = (self.arrived + 1) % len(self.names)      # 0: every group is in
        send, self.staging = (None, self.staging) if self.arrived else (self.staging, None)
        return send


def buckets(layout: Layout, bucket_floats: int, rank: int) -> list[GroupBucket]:
    """The groups in backward order (the head first), merged until a bucket is at least `bucket_floats`."""
    ranges, out, names = layout.group_ranges(), [], []
    for name in reversed(list(ranges)):
        names.append(name)
        if sum(ranges[n][1] - ranges[n][0] for n in names) >= bucket_floats or name == next(iter(ranges)):
            out.append(GroupBucket(names, ranges, layout, rank))
            names = []
    return out


class ShardedGradReducer(GradReducer):
    """Reduce each bucket of groups' gradient into the shard as it is made (see the module)."""

    accumulates = False   # nothing accumulates in a flat buffer: there is none

    def __init__(self, grid, layout: Layout, bucket_floats: int, progress: Progress, loss_weight: float = 1.0,
                 bf16: bool = False):
        super().__init__(grid, layout, None, loss_weight)
        # bf16: the pieces in bfloat16, summed in float32 here (capstone.parallel.bf16sum)
        self.bf16, self.buckets, self.progress = bf16, buckets(layout, bucket_floats, grid.dp.rank), progress
        self.bucket_of = {name: bucket for bucket in self.buckets for name in bucket.names}
        # inflight: (ticket, send, into, bucket, first, held) of the reduction in flight, if any
        self.inflight, self.first, self.peak_inflight = [], True, 0

    def start(self, micro_batches: int) -> None:
        self.first = True

    def landed(self, name: str, g: np.ndarray) -> None:
        """Group `name`'s gradient `g` (this micro-batch's), from the model's seam, is staged; a full
        bucket starts summing into the shard once the reduction before it is done."""
        bucket = self.bucket_of[name]
        send = bucket.add(name, g)
        if send is None:
            return
        held = self._held(bucket, 0 if self.first else 1)
        self.peak_inflight = max(self.peak_inflight, held + sum(i[5] for i in self.inflight))
        self._drain()
        if self.bf16:
            into = Pieces(self.dp, send, bucket.counts)
            request = into.request
        else:
            into = self.grad_shard[bucket.recv] if self.first else np.empty(bucket.recv.stop - bucket.recv.start, DTYPE)
            request = self.dp.Ireduce_scatter(np.ascontiguousarray(send, dtype=DTYPE), into, bucket.counts)
        self.inflight.append((self.progress.submit(request, send, into), send, into, bucket, self.first, held))

    def _drain(self) -> None:
        """Finish the reductions in flight, oldest first."""
        for ticket, send, into, bucket, first, _ in self.inflight:
            ticket.wait(self.dp, "reduce-scatter of a gradient bucket (ZeRO-2)", "reduce_scatter", "reduce_scatterv",
                        send.size * (2 if self.bf16 else 4))
            if self.bf16:
                into.sum_into(self.grad_shard[bucket.recv], add=not first)
            elif not first:
                np.add(self.grad_shard[bucket.recv], into, out=self.grad_shard[bucket.recv])
        self.inflight = []

    def _held(self, b: GroupBucket, micro: int) -> int:
        """Bytes a bucket's reduction holds: its gradient, and after the first micro-batch its temporary of the
        shard (bf16: its pieces, sent and received, instead)."""
        n = b.counts[self.dp.rank]
        return 4 * (b.b - b.a) + (2 * (b.b - b.a) + 2 * self.dp.size * n if self.bf16 else (micro > 0) * 4 * n)

    def after_backward(self, micro: int) -> None:
        self.first = False

    def finish(self, losses: list[float], flags: Flags) -> GradStats:
        """Wait for the reduction still in flight, then the step's small allreduce."""
        self._drain()
        self.dp.hooks.gradients(self.dp.hooks.step, 0, self.grad_shard)   # --inject-nan (a test seam)
        return self.stats(sum(losses), flags)

    def nbytes(self) -> int:
        """The shard and the most the reductions have held in flight (over the run)."""
        return self.grad_shard.nbytes + self.peak_inflight

    def bound(self, micro_batches: int) -> int:
        """The formula for `nbytes`: the shard, and for `peak_inflight` the largest two buckets sent
        one after the other in a step of `micro_batches` (the last of a micro-batch is still in
        flight when the next one's first is sent; after the first micro-batch, each with its
        temporary of the shard)."""
        sent = [self._held(b, j) for j in range(micro_batches) for b in self.buckets]
        return self.grad_shard.nbytes + max([sent[0]] + [x + y for x, y in zip(sent, sent[1:])])
