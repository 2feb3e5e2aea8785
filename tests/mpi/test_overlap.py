"""The bucketed, overlapped gradient reduce-scatter (capstone.parallel.buckets) equals the single one.

Run under mpirun (4 ranks): mpirun --oversubscribe -n 4 python -m pytest -q tests/mpi/test_overlap.py
Sub-communicators (Split) give worlds of 1, 2, 3 and 4 ranks inside one 4-rank job. Gradients are
derived from the rank; the answers are known by formula (float64 sums). Claims checked:
  - bucketed == one non-blocking reduce-scatter (--no-overlap), bit for bit, at every world size
    and bucket size (libnbc sums every element in the same binomial-tree order);
  - both == the blocking Reduce_scatter to float32 rounding, bit for bit at 1-2 ranks and at 4
    ranks for small buffers (coll/tuned's recursive halving = the bit-reversed tree order);
  - 4 ranks == 2 ranks each holding the sum of two ranks' gradients (what --grad-accum 2 on half
    the ranks accumulates), bit for bit, at any size;
  - from a real backward pass with gradient accumulation: buckets start during the backward pass,
    only on the last micro-batch, and the result equals reducing after the backward pass.
"""

import numpy as np
import pytest
from mpi4py import MPI

from capstone.config import ModelConfig
from capstone.model.gpt import Model
from capstone.model.params import Layout, init_params
from capstone.model.seam import Resident
from capstone.parallel.buckets import plan, tree_order
from capstone.parallel.buckets import BucketReducer
from capstone.collective.comm import Comm
from capstone.parallel.grid import Grid
from capstone.parallel.reduce import Flags

CFG = ModelConfig(vocab_size=13, seq_len=4, d_model=8, n_heads=2, n_layers=2)
BIG = ModelConfig(vocab_size=64, seq_len=16, d_model=128, n_heads=4, n_layers=2)   # ~0.5M floats


def sub(comm, size: int):
    """A communicator of the first `size` ranks (None on the others: they skip the check; None
    everywhere when the job has fewer ranks, a decision every rank makes alike)."""
    if size > comm.Get_size():
        return None
    part = comm.Split(0 if comm.Get_rank() < size else MPI.UNDEFINED, comm.Get_rank())
    return None if part == MPI.COMM_NULL else part


def grad(layout, rank, seed=0):
    """Rank `rank`'s gradient: mixed magnitudes, so the order of additions shows in the bits."""
    rng, n = np.random.default_rng([seed, rank]), layout.n_params   # (the same values at any padding)
    g = layout.zeros()
    g[:n] = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
    return g


def reduce(comm, layout, g, bucket_floats):
    reducer = BucketReducer(Grid.build(Comm(comm)), layout, g, bucket_floats)
    reducer.finish([0.0], Flags())
    return reducer.grad_shard


def blocking(comm, layout, g):
    shard = np.empty(layout.shard, dtype=np.float32)
    comm.Reduce_scatter(g, shard, [layout.shard] * comm.Get_size(), op=MPI.SUM)
    return shard


def test_tree_order_is_bit_reversal():
    assert tree_order(1) == [0] and tree_order(2) == [0, 1] and tree_order(3) == [0, 1, 2]
    assert tree_order(4) == [0, 2, 1, 3]
    assert tree_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_covers_the_buffer_in_whole_parameters(world):
    layout = Layout.for_model(CFG, world)
    starts = {off for _, _, off in layout.entries}
    for floats in (1, 100, 1000, layout.padded):
        buckets = plan(layout, floats, 0, tree_order(world))
        assert buckets[0].a == 0 and buckets[-1].b == layout.padded
        assert all(x.b == y.a for x, y in zip(buckets, buckets[1:]))
        assert all(b.a in starts for b in buckets)
        assert all(b.b - b.a >= floats for b in buckets[1:])
        assert sum(sum(b.counts) for b in buckets) == layout.padded
        for r in range(world):   # every rank's shard is received exactly once, in order
            pieces = sorted((b.recv.start, b.recv.stop) for b in plan(layout, floats, r, tree_order(world)))
            got = [p for p in pieces if p[1] > p[0]]
            assert got[0][0] == 0 and got[-1][1] == layout.shard and all(x[1] == y[0] for x, y in zip(got, got[1:]))
    assert len(plan(layout, layout.padded)) == 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", [CFG, BIG], ids=["small", "big"])
def test_bucketed_equals_single_reduce_scatter(world, cfg):
    comm = sub(MPI.COMM_WORLD, world)
    if comm is None:
        return
    rank = comm.Get_rank()
    layout = Layout.for_model(cfg, world)
    g = grad(layout, rank)
    lo, hi = layout.shard_range(rank)
    want = sum(grad(layout, r).astype(np.float64) for r in range(world))[lo:hi]
    single = reduce(comm, layout, g.copy(), layout.padded)
    np.testing.assert_allclose(single, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    for floats in (1, 1000, 20_000):
        assert np.array_equal(reduce(comm, layout, g.copy(), floats), single), f"{floats} floats per bucket"
    assert np.array_equal(g, grad(layout, rank)), "the gradient buffer must not change"
    block = blocking(comm, layout, g)
    np.testing.assert_allclose(block, single, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    if world <= 2 or (world == 4 and cfg is CFG):
        assert np.array_equal(block, single), "bit-identical to the blocking Reduce_scatter here"
    comm.Free()


@pytest.mark.parametrize("cfg", [CFG, BIG], ids=["small", "big"])
def test_four_ranks_equal_two_ranks_accumulating_pairs(cfg):
    """Rank r of 2 holds g_r + g_{r+2} (micro-batch j of rank r is global block j*world + r)."""
    world = Comm(MPI.COMM_WORLD)
    if world.size != 4:
        pytest.skip("needs 4 ranks")
    l4, l2 = Layout.for_model(cfg, 4), Layout.for_model(cfg, 2)
    four = reduce(MPI.COMM_WORLD, l4, grad(l4, world.rank), 1000)
    full4 = np.empty(l4.padded, dtype=np.float32)
    world.Allgather(full4, "test", send=four)
    comm = sub(MPI.COMM_WORLD, 2)
    if comm is not None:
        r = comm.Get_rank()
        mine = np.zeros(l2.padded, dtype=np.float32)
        for other in (r, r + 2):             # accumulated in place, as the tap VJP does
            np.add(mine, grad(l2, other), out=mine)
        two = reduce(comm, l2, mine, 1000)
        lo, hi = l2.shard_range(r)
        assert np.array_equal(two[:max(0, min(hi, l4.n_params) - lo)], full4[lo:min(hi, l4.n_params)])
        comm.Free()


def test_overlap_from_backward_with_accumulation(grid, world):
    layout = Layout.for_model(CFG, world.size)
    rng = np.random.default_rng(world.rank)
    batches = [(rng.integers(0, CFG.vocab_size, (2, CFG.seq_len)), rng.integers(0, CFG.vocab_size, (2, CFG.seq_len)))
               for _ in range(3)]
    grads = layout.zeros()
    overlap = BucketReducer(grid, layout, grads, 200)
    plain = BucketReducer(grid, layout, grads, layout.padded)
    model = Model(CFG, layout, Resident.over(layout, init_params(layout, CFG, 3), grads, overlap.landed))
    assert len(overlap.buckets) > 3
    overlap.start(len(batches))
    model.forward_backward(batches, 0.01)
    started = overlap.next
    assert started < len(overlap.buckets) - 1, "no bucket started during the backward pass"
    assert started == 0, "every bucket but bucket 0 starts during the backward pass"
    model.grads[0] += 1.0                   # touched after backward (like --inject-nan): bucket 0 sees it
    a = overlap.finish([1.0], Flags())
    b = plain.finish([1.0], Flags())
    assert np.array_equal(overlap.grad_shard, plain.grad_shard)
    assert a.norm == b.norm and a.loss == b.loss == world.size
    # finished: a later backward pass starts nothing
    model.forward_backward(batches[:1], 0.01)
    assert overlap.requests == []
