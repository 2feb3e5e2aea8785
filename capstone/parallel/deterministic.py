"""`--deterministic`: every floating-point reduction in a fixed order set by sample index, not by rank.

With a fixed global batch of G sequences and a fixed per-rank micro-batch of B sequences, the
step's losses, gradient norms, held-out losses, parameters and checkpoints are then bit-identical
for every layout ranks x grad_accum with ranks * grad_accum = G / B (1x4, 2x2, 4x1; 1x3, 3x1),
and across a resume on another world size. docs/deterministic.md has the scheme and the proof.

- A *block* is one micro-batch: B consecutive samples of the step. Block k starts at sample
  cursor + k*B (data.py puts rank r's micro-batch j at block k = j*world + r). Its gradient is
  computed alone into a zeroed flat buffer: the same inputs, shapes and code on one thread give
  the same bits whichever rank computes it.
- `DeterministicReducer` (capstone.parallel.reduce's interface): every rank sends each of its
  blocks' shard slices to the shard owners (one Alltoall per block, right after its backward, so
  one gradient buffer serves every block; the received rows come out in block order
  k = j*world + q), and each owner sums the K = G/B rows of its shard in `tree_rows`' fixed tree
  over block indices. So the bucketed overlap does not apply: the exchange follows each micro-
  batch's backward pass (capstone.modes says so when buckets were asked for). The sum
  is elementwise, so each element's result depends only on the K block values of that element:
  not on where the shard boundaries fall (which moves with the world size).
- The loss: every block's loss is allgathered and summed in the same tree over block indices.
- The gradient norm: sums of squares per fixed chunk of FIXED_CHUNK values of the canonical
  (1-rank, unpadded) vector, each chunk assembled by its owner whatever the layout, added in a
  fixed tree over chunk indices (capstone.parallel.chunksums).
- `HeldOutBlocks`: the held-out loss per fixed block of EVAL_ROWS rows, blocks dealt round-robin
  to the ranks, the block losses allgathered and tree-summed.
- Adam, clipping and the allgather of the parameters are elementwise or a copy: exact once their
  inputs are. A block's gradient is the same bits on every layout because the layers' arithmetic
  is cut the same way on every layout (capstone.model.exact).

The cost: `mpirun -n 4 python -m benchmarks.determinism [--repeats 3] [--reduction-only]`.
"""

import math

import numpy as np

from capstone.data.heldout import HeldOut
from capstone.model.exact import tree
from capstone.parallel.grid import allgathered
from capstone.parallel.reduce import Flags, GradReducer, GradStats

FIXED_CHUNK = 1 << 14   # values per chunk of the gradient norm's (and param_norm's) sum of squares
EVAL_ROWS = 4          # held-out rows per evaluation block


# ---- the fixed trees ---------------------------------------------------------------------------

def tree_rows(rows: np.ndarray, out: np.ndarray) -> None:
    """Sum rows[0..K-1] (K x S) into `out` in the fixed tree of pairs over row indices (capstone.model.exact.tree:
    at stride 1, 2, 4, ... row i += row i+stride for i a multiple of 2*stride). Overwrites `rows`."""
    out[...] = tree(list(rows))


def tree_sum(values) -> float:
    """The same tree over a sequence of float64 scalars."""
    return float(tree([np.float64(x) for x in values] or [0.0]))


def sumsq(values: np.ndarray) -> float:
    """Sum of squares of one chunk in float64 (squares of float32 are exact in float64; the sum is
    NumPy's pairwise sum, a function of the values and the length only)."""
    x = np.asarray(values, dtype=np.float64)
    return float(np.add.reduce(x * x))


class DeterministicReducer(GradReducer):
    """Each micro-batch's gradient alone, exchanged to the shard owners after its backward pass
    (`grads` None, ZeRO-2/3: each group's as the backward makes it), then fixed-order trees for the
    gradient, the loss and the norm (see the module)."""

    accumulates = False   # every micro-batch overwrites the flat gradient buffer

    def __init__(self, grid, layout, grads, grad_accum: int, chunks):
        super().__init__(grid, layout, grads)
        self.chunks = chunks    # the norm: of the canonical vector's chunks (capstone.parallel.chunksums.ChunkSums)
        self.micro, self.plans = 0, None if grads is not None else group_plans(layout, grid.dp.rank)
        self.accum, self.w = grad_accum, grid.dp.size
        # a replica's parts (pipeline stage p, tensor-parallel rank t: part p * tp + t), the ranks of the
        # part whose losses are the replica's (the last stage's t = 0) in dp x cp order, replica 0's ranks
        self.loss_ranks = [r for r in range(grid.world.size) if grid.part(r) == (grid.pp.size - 1) * grid.tp.size]
        # rows[j, q]: rank q's block j, this rank's shard of it (block k = j*world + q of the step)
        self.rows = np.zeros((grad_accum, self.w, layout.shard), dtype=np.float32)   # padding stays 0

    def nbytes(self) -> int:
        """Bytes this mode holds besides the flat buffer: the received rows (grad_accum x the
        flat buffer) and the gradient shard (ZeRO-2/3: no flat buffer, the same rows)."""
        return self.rows.nbytes + self.grad_shard.nbytes

    def bound(self, micro_batches: int) -> int:
        """The formula: a shard-long row per rank and micro-batch, and the shard they sum into."""
        return 4 * (micro_batches * self.w + 1) * self.layout.shard

    def before_backward(self, micro: int) -> None:
        self.micro = micro

    def landed(self, name: str, grad: np.ndarray) -> None:
        """ZeRO-2/3: group `name`'s gradient of this micro-batch, each rank's piece of it to that
        rank (into the rows of block micro*world + q, where a flat buffer's exchange puts it)."""
        if self.plans is not None:
            send, recv = self.plans[name]   # (counts, displacements) each
            self.dp.Alltoallv(np.ascontiguousarray(grad.reshape(-1)), send, self.rows[self.micro], recv,
                              f"deterministic exchange of the gradient of {name}")

    def after_backward(self, micro: int) -> None:
        """Slice q of the flat gradient buffer to rank q (rows of block micro*world + q)."""
        if self.plans is None:
            self.dp.Alltoall(self.grads, self.rows[micro], "deterministic exchange of a micro-batch's gradient")

    def finish(self, losses: list[float], flags: Flags) -> GradStats:
        """Collective: the owner's tree over the received rows; one allgather over the world of each
        rank's block losses, flags and its part's sum of squares (a replicated parameter counted on
        tensor-parallel rank 0 only); the loss tree over blocks and the norm's over parts, in fixed
        orders (the parts of a replica do not depend on the data-parallel layout)."""
        tree_rows(self.rows.reshape(-1, self.layout.shard), self.grad_shard)   # row k = j*world + q; padding: zeros
        if self.plans is not None:   # --inject-nan (a test seam), where no flat buffer is
            self.dp.hooks.gradients(self.dp.hooks.step, 0, self.grad_shard)
        square = self.chunks(self.grad_shard)[0]
        small = np.array([*losses, *flags.counts(), square], dtype=np.float64)
        self.agreeing()
        every = allgathered(self.world, small, "allgather of the micro-batch losses and norms", "allgather_stats")
        # (dp x cp, accum) of the loss-holding parts; index j*world + q = block k (--cp: its part q % cp)
        loss = tree_sum(every[self.loss_ranks, :self.accum].T.reshape(-1))
        return GradStats(loss, math.sqrt(square), Flags.any_rank(every[:, self.accum:-1].sum(axis=0)))


def group_plans(layout, rank: int) -> dict:
    """For each parameter group [a, b): the Alltoallv specs (counts, displacements) of its pieces:
    to rank q the part in q's shard, and from every rank this rank's part, at its place in that
    rank's row of shard length."""
    from capstone.parallel.zero2 import GroupPlan   # a group's counts per rank and this rank's slice
    shard, w = layout.shard, layout.world
    plans = {name: GroupPlan(a, b, layout, rank) for name, (a, b) in layout.group_ranges().items()}
    return {name: ((g.counts, [max(0, q * shard - g.a) if c else 0 for q, c in enumerate(g.counts)]),
                   ([g.counts[rank]] * w, [q * shard + g.recv.start for q in range(w)])) for name, g in plans.items()}


# ---- the held-out evaluation -------------------------------------------------------------------

class HeldOutBlocks(HeldOut):
    """The held-out loss in fixed blocks of EVAL_ROWS rows of each held-out batch (block b to rank
    b % world). `loss_share` is a collective that returns the tree-summed mean loss per token on
    rank 0 and 0.0 elsewhere, so the caller's sum over ranks adds exact zeros to it."""

    def __init__(self, data, batches: int, batch_size: int, seq_len: int, world, dp, loss, weight: float = 1.0,
                 in_step: bool = False, cp: int = 1):
        # --cp: the k ranks of a ring evaluate the same blocks, each its part; parts tree-summed in order
        self.world, self.comm, self.rank, self.w, self.loss = world, dp, dp.rank // cp, dp.size // cp, loss
        # weight: 1 on the parts whose loss is the replica's (capstone.data.heldout)
        self.weight, self.scale = weight, 1.0 / (batches * batch_size * seq_len)
        spans = [(k, a, min(a + EVAL_ROWS, batch_size)) for k in range(batches) for a in range(0, batch_size, EVAL_ROWS)]
        self.per_rank, self.counted = -(-len(spans) // self.w), len(spans) * cp   # counted: the blocks' parts
        mine = spans[self.rank::self.w]
        # in_step: the forward is a collective over dp (ZeRO-3's gathers), so every rank runs as many: a rank short
        # of a block runs the first one again, its loss past the last block's index (not summed)
        mine += spans[:1] * (self.per_rank - len(mine)) * in_step
        full = {k: data.val_batch(k, batch_size) for k in {k for k, _, _ in mine}}
        self.blocks = [(full[k][0][a:b].copy(), full[k][1][a:b].copy()) for k, a, b in mine]

    def loss_share(self) -> float:
        local = np.zeros(self.per_rank, dtype=np.float64)
        local[:len(self.blocks)] = [self.loss(x, y, self.scale) for x, y in self.blocks]
        every = allgathered(self.comm, local, "allgather of the held-out block losses", "allgather_eval")
        # index i*world + q = block b * cp + part
        return tree_sum(every.T.reshape(-1)[:self.counted]) * self.weight if self.comm.rank == 0 else 0.0
