"""chunksums.ChunkSums: the same bits on 1..N ranks as the serial reference; the fixed trees."""

import numpy as np
import pytest
from mpi4py import MPI

from capstone.collective.comm import Comm
from capstone.model.fingerprint import fingerprint
from capstone.parallel.deterministic import tree_rows, tree_sum


def test_trees_agree_and_are_fixed():
    rows = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    out = np.empty(5, dtype=np.float32)
    tree_rows(rows.copy(), out)
    r = rows
    want = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + r[6])
    assert np.array_equal(out, want)
    assert tree_sum(rows[:, 0].astype(np.float64)) == float(
        ((np.float64(r[0, 0]) + r[1, 0]) + (np.float64(r[2, 0]) + r[3, 0])) + ((np.float64(r[4, 0]) + r[5, 0]) + r[6, 0]))


@pytest.mark.parametrize("n", [1037, 40000, 70000])   # one chunk, a split last chunk, five chunks
def test_chunk_sums_of_any_partition_are_the_whole_vectors(world, n):
    """chunksums.ChunkSums on the first k ranks, every k: whatever values each rank holds (a shuffled partition,
    some values held twice and counted once), the sum of squares and both fingerprints of the canonical vector, as
    `whole` and capstone.model.fingerprint give on one process."""
    from capstone.parallel.chunksums import ChunkSums, whole
    full = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    want = whole(full)
    for k in range(1, world.size + 1):
        sub = world.mpi.Split(0 if world.rank < k else MPI.UNDEFINED, world.rank)
        if sub == MPI.COMM_NULL:
            continue
        owner = np.random.default_rng(n + k).integers(0, k, n)               # the same on every rank
        mine = np.flatnonzero(owner == world.rank)
        twice = np.flatnonzero(owner == (world.rank + 1) % k)[:50] if k > 1 else mine[:0]
        idx = np.concatenate([mine, np.full(len(twice), -1)])                 # a copy another rank counts: -1
        values = np.concatenate([full[mine], full[twice]])
        order = np.random.default_rng(world.rank).permutation(len(idx))
        sums = ChunkSums(Comm(sub), idx[order], n)
        assert sums(values[order], digest="sha256") == want, k
        assert sums(values[order] * 2, digest="sha256") != want              # it can fail
        assert sums(values[order], digest="words") == (want[0], fingerprint(full, strong=False)[1])
        sub.Free()
