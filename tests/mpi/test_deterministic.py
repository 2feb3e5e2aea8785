"""deterministic.ShardNorm: the same bits on 1..N ranks as the serial fixed-chunk reference."""

import math

import numpy as np
import pytest
from mpi4py import MPI

from capstone.collective.comm import Comm
from capstone.parallel.deterministic import ShardNorm, chunked_sumsq, tree_rows, tree_sum


@pytest.mark.parametrize("n,chunk", [(1037, 100), (1000, 100), (50, 100), (30144, 1 << 14)])
def test_shard_norm_is_the_same_on_every_world_size(world, n, chunk):
    full = np.random.default_rng(n).standard_normal(n).astype(np.float32) * np.float32(1e-3)
    want = math.sqrt(chunked_sumsq(full, n, chunk))
    for k in range(1, world.size + 1):  # sub-communicators of the first k ranks
        sub = world.mpi.Split(0 if world.rank < k else MPI.UNDEFINED, world.rank)
        if sub != MPI.COMM_NULL:
            shard = -(-n // k)
            padded = np.zeros(shard * k, dtype=np.float32)
            padded[:n] = full
            got = ShardNorm(Comm(sub), n, shard, chunk)(padded[world.rank * shard:(world.rank + 1) * shard])
            assert got == want, (k, got, want)
            sub.Free()


def test_trees_agree_and_are_fixed():
    rows = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    out = np.empty(5, dtype=np.float32)
    tree_rows(rows.copy(), out)
    r = rows
    want = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + r[6])
    assert np.array_equal(out, want)
    assert tree_sum(rows[:, 0].astype(np.float64)) == float(
        ((np.float64(r[0, 0]) + r[1, 0]) + (np.float64(r[2, 0]) + r[3, 0])) + ((np.float64(r[4, 0]) + r[5, 0]) + r[6, 0]))
