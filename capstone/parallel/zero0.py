"""ZeRO stage 0: plain data parallelism (PyTorch DDP, DeepSpeed stage 0), imported for --zero-stage 0.

Every rank holds the whole optimizer state (12 bytes per parameter: master, m, v) and updates the
whole model with the whole reduced gradient, so nothing is gathered after the update. The gradient
is ALLREDUCED in place in the flat buffer, bucket by bucket, overlapped with the backward pass:
ZeRO-1's buckets, plan and order (capstone.parallel.buckets), an Iallreduce per bucket instead of
an Ireduce_scatter (it moves twice the bytes: 2(N-1)/N of the buffer per rank against (N-1)/N for
the reduce-scatter and (N-1)/N for stage 1's parameter allgather: the same total). With
--deterministic the fixed-order reducer makes this rank's shard of the gradient as at stage 1 and
the shards are allgathered into the buffer (`Allgathered`): the same bits as stage 1's.

Checkpoints are the canonical layout of every stage: `ReplicatedView` hands the checkpoint its
data-parallel shard of the replicated state (the file is stage 1's, so it resumes at any stage and
world size) and rebuilds the whole state from the shards on load.
"""

from capstone.model.fingerprint import sum_squares
from capstone.model.params import Layout
from capstone.parallel.buckets import BucketReducer, GroupPlan
from capstone.parallel.grid import allgathered
from capstone.parallel.reduce import Flags, GradStats
from capstone.parallel.zero import ZeroAdam
from capstone.step.state import ShardState


class AllreduceReducer(BucketReducer):
    """Sum `grads` over the data-parallel group in place, bucket by bucket: `grad_shard` is the
    whole buffer (what the replicated optimizer updates with)."""

    tree, op = False, "allreduce"      # no staging: the allreduce sums whole buckets, in the library's order

    def __init__(self, grid, layout: Layout, grads, bucket_floats: int, loss_weight: float = 1.0):
        super().__init__(grid, layout, grads, bucket_floats, loss_weight)
        self.grad_shard, (self.lo, self.hi) = grads, layout.shard_range(grid.dp.rank)

    def _request(self, b: GroupPlan):
        return self.comm.Iallreduce(self.grads[b.a:b.b])

    def stats(self, loss: float, flags: Flags) -> GradStats:
        """The norm over this rank's shard of the (replicated) sum: each element counted once."""
        return super().stats(loss, flags, sum_squares(self.grads[self.lo:self.hi], self.norm_weight))

    def nbytes(self) -> int:
        return 0     # in place: the flat buffer is the reduced gradient

    def bound(self, micro_batches: int) -> int:
        return 0


class Allgathered:
    """--deterministic at stage 0: `inner` (a reducer into this rank's shard) then an allgather of
    the shards into its flat buffer, which is then the whole reduced gradient (`grad_shard`)."""

    def __init__(self, inner):
        self.inner, self.grad_shard, self.grads, self.accumulates = inner, inner.grads, inner.grads, inner.accumulates
        self.start, self.before_backward, self.after_backward = inner.start, inner.before_backward, inner.after_backward
        self.landed, self.nbytes, self.bound = inner.landed, inner.nbytes, inner.bound

    def finish(self, losses: list[float], flags: Flags) -> GradStats:
        stats = self.inner.finish(losses, flags)
        self.inner.dp.Allgather(self.grad_shard, "allgather of the reduced gradient", "allgather_grads",
                                send=self.inner.grad_shard)
        return stats


class ReplicatedAdam(ZeroAdam):
    """Adam(W) on every element on every rank (no allgather): the state is the whole buffer's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, replicate=True, **kwargs)

    def _publish(self) -> None:
        self.cast(self.params, self.state.master)


class ReplicatedView:
    """The checkpoints' view of a replicated state: its data-parallel shard, through `inner` (the
    model-parallel view, None: as is); on load, the shards allgathered into the whole state."""

    def __init__(self, dp, layout: Layout, inner=None):
        self.dp, self.layout, self.inner, (self.lo, self.hi) = dp, layout, inner, layout.shard_range(dp.rank)

    def to_stored(self, state: ShardState) -> ShardState:
        """Collective. This rank's shard, as stage 1 stores it."""
        shard = ShardState(*(a[self.lo:self.hi] for a in state.rows()), t=state.t)
        return shard if self.inner is None else self.inner.to_stored(shard)

    def from_stored(self, stored: ShardState) -> ShardState:
        """Collective. The whole state from every rank's shard."""
        shard = stored if self.inner is None else self.inner.from_stored(stored)
        return ShardState(*(allgathered(self.dp, a, "checkpoint: allgather of the optimizer shards").reshape(-1)
                            for a in shard.rows()), t=shard.t)

    def whole(self, params):
        return params if self.inner is None else self.inner.whole(params)

    def describe(self) -> dict:
        return {} if self.inner is None else self.inner.describe()

