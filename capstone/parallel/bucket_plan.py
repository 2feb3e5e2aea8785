"""The plan of the bucketed gradient reduce-scatter (capstone.parallel.buckets): where the buckets
of the flat buffer begin and end, how many values each rank receives of each, and the rank order
of the reduce-scatter's communicator (bit-reversed for a power-of-2 world, so the tree sums in
recursive-halving order). Made once, when the run is built.
"""

from __future__ import annotations

from capstone.model.params import Layout


def tree_order(world: int) -> list[int]:
    """order[j] = the rank at position j of the reduce-scatter's communicator: bit-reversed for a
    power-of-2 world (an involution), else the identity. libnbc's binomial tree pairs positions
    (0,1), (2,3), ... first; over bit-reversed ranks it pairs ranks 0 and W/2 first: the order of
    recursive halving, which is also the order in which a run on W/2^k ranks with --grad-accum 2^k
    accumulates the same samples (rank r's micro-batch j is global block j*world + r)."""
    bits = world.bit_length() - 1
    if world < 4 or world != 1 << bits:
        return list(range(world))
    return [int(format(j, f"0{bits}b")[::-1], 2) for j in range(world)]


class Bucket:
    """One contiguous range [a, b) of the flat buffer, its counts in the reduce-scatter's rank
    order, and where this rank's piece lands in g_shard."""

    def __init__(self, a: int, b: int, params: list[int], layout: Layout, rank: int, order: list[int]):
        self.a, self.b, self.params = a, b, params
        pieces = [(max(a, lo), min(b, hi)) for lo, hi in map(layout.shard_range, range(layout.world))]
        self.counts = [max(0, pieces[o][1] - pieces[o][0]) for o in order]   # by position in the tree order
        lo = layout.shard_range(rank)[0]
        n = max(0, pieces[rank][1] - pieces[rank][0])
        self.recv = slice(max(a, lo) - lo, max(a, lo) - lo + n)               # within g_shard
        # with a non-identity order the pieces are staged in that order: (staging slice, grads slice)
        self.copies, pos = [], a
        for o, n_o in zip(order, self.counts):
            if n_o:
                self.copies.append((slice(pos, pos + n_o), slice(pieces[o][0], pieces[o][0] + n_o)))
                pos += n_o


def plan(layout: Layout, bucket_floats: int, rank: int = 0, order: list[int] | None = None) -> list[Bucket]:
    """Buckets in flat order (bucket 0 starts at 0), filled from the end: whole parameters, each
    bucket at least `bucket_floats` long except bucket 0 (the remainder). The padding goes with
    the last parameter."""
    order = order or list(range(layout.world))
    entries = sorted(layout.entries, key=lambda e: e[2])
    bounds, end, params = [], layout.padded, []
    for i in range(len(entries) - 1, -1, -1):
        params.append(i)
        start = entries[i][2]
        if end - start >= bucket_floats or i == 0:
            bounds.append((0 if i == 0 else start, end, sorted(params)))
            end, params = start, []
    return [Bucket(a, b, p, layout, rank, order) for a, b, p in reversed(bounds)]
