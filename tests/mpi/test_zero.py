"""ZeRO-1 on N ranks equals plain single-process AdamW on the same gradients; the one-shot gradient
reduction sums gradients, losses and flags; revert and load_state restore exactly."""

import numpy as np
import pytest

from capstone.config import ModelConfig
from capstone.model.params import Layout, init_params
from capstone.parallel.buckets import BucketReducer
from capstone.parallel.reduce import Flags
from capstone.parallel.zero import ZeroAdam
from capstone.step.state import ShardState

CFG = ModelConfig(vocab_size=13, seq_len=4, d_model=8, n_heads=2, n_layers=1)


def rank_grad(layout, step, rank):
    """The gradient rank `rank` contributes at `step`: a formula every rank can evaluate. Magnitudes
    spread over ten decades (1e-10 .. 1), so Adam's epsilon (1e-8) matters for some elements."""
    rng = np.random.default_rng([step, rank])
    g = (rng.standard_normal(layout.padded) * 10.0 ** rng.uniform(-10, 0, layout.padded)).astype(np.float32)
    g[layout.n_params:] = 0.0
    return g


def reference_adam(p, grads, lr, b1, b2, eps, wd, decay):
    """Textbook AdamW (Loshchilov & Hutter) on the full vector, in float64. Returns the parameters,
    and per element the path length (sum of |step|) and the largest |p| along the way."""
    p, m, v = p.astype(np.float64), np.zeros(len(p)), np.zeros(len(p))
    path, biggest = np.zeros(len(p)), np.abs(p)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        new = p - lr * wd * decay * p
        new = new - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
        path, p = path + np.abs(new - p), new
        biggest = np.maximum(biggest, np.abs(p))
    return p, path, biggest


def one_shot(grid, layout, grads):
    return BucketReducer(grid, layout, grads, layout.padded)


@pytest.mark.parametrize("wd,chunk", [(0.0, None), (0.1, None), (0.1, 37)])
def test_zero1_equals_plain_adam(grid, world, wd, chunk, monkeypatch):
    """Every parameter within float32 rounding of the float64 reference (2e-6 of the path it
    travelled, plus half an ulp of float32 per step): a moved epsilon, a missing bias correction or
    a wrong decay is far outside it."""
    if chunk:  # the update in passes of 37 elements: several per shard, and a shorter last one
        monkeypatch.setattr("capstone.parallel.zero.ADAM_CHUNK", chunk)
    layout = Layout.for_model(CFG, world.size)
    params = init_params(layout, CFG, 5) if world.rank == 0 else layout.zeros()
    model_grads = layout.zeros()
    opt = ZeroAdam(grid.dp, layout, params, (0.9, 0.99), 1e-8, wd)
    reducer = one_shot(grid, layout, model_grads)
    start = params.copy()
    assert np.array_equal(start, init_params(layout, CFG, 5)), "parameters were not broadcast from rank 0"
    summed = []
    for step in range(5):
        model_grads[...] = rank_grad(layout, step, world.rank)
        stats = reducer.finish([0.0], Flags())
        total = sum(rank_grad(layout, step, r).astype(np.float64) for r in range(world.size))
        assert stats.norm == pytest.approx(np.linalg.norm(total), rel=1e-6)
        reduced = layout.zeros()   # the reference starts from the same float32 sums (summing is tested below)
        world.Allgather(reduced, "test", send=reducer.grad_shard.copy())
        summed.append(reduced.astype(np.float64))
        opt.apply(reducer.grad_shard, 1e-2, stats.norm)
    decay = np.zeros(layout.padded)
    for _, shape, off in layout.entries:
        if len(shape) >= 2:
            decay[off:off + int(np.prod(shape))] = 1.0
    want, path, biggest = reference_adam(start, summed, 1e-2, 0.9, 0.99, 1e-8, wd, decay)
    allowed = 2e-6 * path + 5 * 0.5 * np.spacing(biggest.astype(np.float32))   # a few float32 ops a step
    assert np.all(np.abs(params - want) <= allowed), np.max(np.abs(params - want) / allowed)
    every = world.allgather_json(params.tobytes().hex()[:64] + str(float(params.sum())))
    assert len(set(every)) == 1
    assert opt.state.nbytes == 12 * layout.padded // world.size


def test_reducer_sums_gradients_losses_and_flags_and_carries_nonfinite(grid, world):
    layout = Layout.for_model(CFG, world.size)
    grads = layout.zeros()
    reducer = one_shot(grid, layout, grads)
    grads[...] = world.rank + 1.0
    grads[layout.n_params:] = 0.0
    n = world.size
    stats = reducer.finish([float(world.rank), 0.5], Flags(stop=world.rank == n - 1, clock_due=False))
    assert stats.loss == n * (n - 1) / 2 + 0.5 * n
    assert stats.flags == Flags(stop=True, clock_due=False)
    assert stats.norm == pytest.approx(np.sqrt(layout.n_params) * n * (n + 1) / 2, rel=1e-6)
    lo, hi = layout.shard_range(world.rank)
    want = np.full(hi - lo, n * (n + 1) / 2, dtype=np.float32)
    want[max(0, layout.n_params - lo):] = 0.0
    assert np.array_equal(reducer.grad_shard, want)
    grads[3] = np.nan if world.rank == world.size - 1 else 0.0
    assert not np.isfinite(reducer.finish([0.0], Flags()).norm)


def test_load_state_rebuilds_identical_params(grid, world):
    layout = Layout.for_model(CFG, world.size)
    params = init_params(layout, CFG, 1)
    opt = ZeroAdam(grid.dp, layout, params)
    shard = np.arange(layout.shard, dtype=np.float32) + world.rank * layout.shard
    opt.load_state(ShardState(shard, shard * 2, shard * 3, t=7))
    assert np.array_equal(params, np.arange(layout.padded, dtype=np.float32))
    assert opt.state.t == 7 and np.array_equal(opt.state.v, shard * 3)


def test_revert_restores_the_state_before_the_last_update_bit_for_bit(grid, world):
    """apply writes the new state into the spare arrays: revert brings back the exact state (and
    parameters) of before it, once; a second revert keeps that state; the next apply goes on from it."""
    layout = Layout.for_model(CFG, world.size)
    params, grads = init_params(layout, CFG, 1), layout.zeros()
    opt = ZeroAdam(grid.dp, layout, params, weight_decay=0.1, clip=1.0)
    reducer = one_shot(grid, layout, grads)
    grads[:layout.n_params] = np.linspace(-1, 1, layout.n_params, dtype=np.float32) * (world.rank + 1)
    opt.apply(reducer.grad_shard, 1e-2, reducer.finish([0.0], Flags()).norm)
    before = [a.copy() for a in opt.state.rows()], params.copy(), opt.state.t
    norm = reducer.finish([0.0], Flags()).norm
    assert opt.apply(reducer.grad_shard, 1e-2, norm) == 1.0 < norm   # clipped to --clip
    assert not np.array_equal(params, before[1])
    for _ in range(2):
        opt.revert()
        assert all(np.array_equal(a, b) for a, b in zip(opt.state.rows(), before[0]))
        assert np.array_equal(params, before[1]) and opt.state.t == before[2] == 1
    opt.apply(reducer.grad_shard, 1e-2, reducer.finish([0.0], Flags()).norm)
    assert opt.state.t == 2 and not np.array_equal(params, before[1])
