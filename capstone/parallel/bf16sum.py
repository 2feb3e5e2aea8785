"""--precision bf16's gradient exchange: a reduce-scatter of bfloat16 pieces, summed in float32 by their owner.

MPI cannot add bfloat16 (its SUM is defined on its own types), and adding in bfloat16 would round every partial
sum. So each rank narrows its range of the float32 gradient to bfloat16 (capstone.model.precision), one Alltoallv
sends each piece to the rank whose shard it lies in, and that rank widens the pieces and adds them in float32 in
rank order: a fixed order, whichever message came first. Half a float32 reduce-scatter's bytes on the wire; the
pieces in flight are held until they are summed (`BucketPieces.bound`). ZeRO-1's buckets here, ZeRO-2/3's groups
in capstone.parallel.zero2, ZeRO-0 as stage 1 with the summed shards allgathered (capstone.parallel.zero0).
"""

import numpy as np

from capstone.model.precision import BF16, narrow, widen
from capstone.parallel.buckets import BucketReducer, GroupPlan


class Pieces:
    """One float32 range's exchange, started (see the module): `counts[r]` of its values go to rank r."""

    def __init__(self, comm, send: np.ndarray, counts: list[int]):
        n, w = counts[comm.rank], comm.size
        self.bits, self.recv = narrow(send.reshape(-1)), np.empty((w, n), dtype=BF16)
        at = [sum(counts[:r]) for r in range(w)]
        self.request = comm.Ialltoallv(self.bits, (list(counts), at), self.recv, ([n] * w, [r * n for r in range(w)]))
        self.nbytes = self.bits.nbytes + self.recv.nbytes

    def sum_into(self, into: np.ndarray, add: bool = False) -> None:
        """Once the request is done: the pieces' float32 sum, in rank order, written into `into` (`add`: added)."""
        total, piece = widen(self.recv[0]), np.empty(self.recv.shape[1], dtype=np.float32)
        for bits in self.recv[1:]:
            total += widen(bits, out=piece)
        into[...] = into + total if add else total


class BucketPieces(BucketReducer):
    """ZeRO-1's bucketed exchange (capstone.parallel.buckets) with each bucket's pieces in bfloat16."""

    tree, wire = False, 2      # the sums are the owner's, in rank order; 2 bytes a value on the wire

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pieces, self.peak = [], 0   # the buckets' pieces in flight (with their plans); the most bytes they held

    def _request(self, b: GroupPlan):
        pieces = Pieces(self.comm, self.grads[b.a:b.b], b.counts)
        self.pieces.append((pieces, b))
        self.peak = max(self.peak, sum(p.nbytes for p, _ in self.pieces))
        return pieces.request

    def stats(self, loss: float, flags, sumsq=None):
        """The requests are done: each bucket's pieces summed into the shard, then the step's numbers."""
        for pieces, b in self.pieces:
            pieces.sum_into(self.grad_shard[b.recv])
        self.pieces = []
        return super().stats(loss, flags, sumsq)

    def nbytes(self) -> int:
        return self.grad_shard.nbytes + self.peak

    def bound(self, micro_batches: int) -> int:
        """The shard, and every bucket's pieces in flight at once: 2 bytes a value sent and received."""
        return 4 * self.layout.shard + 2 * self.layout.padded + 2 * self.layout.world * self.layout.shard
