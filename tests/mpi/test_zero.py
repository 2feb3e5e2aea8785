"""ZeRO-1 on N ranks equals plain single-process Adam on the same gradients."""

import numpy as np
import pytest

from capstone.config import ModelConfig
from capstone.model.params import Layout, init_params
from capstone.parallel.zero import ShardState, ZeroAdam

CFG = ModelConfig(vocab_size=13, seq_len=4, d_model=8, n_heads=2, n_layers=1)


def rank_grad(layout, step, rank):
    """The gradient rank `rank` contributes at `step`: a formula every rank can evaluate."""
    g = np.random.default_rng([step, rank]).standard_normal(layout.padded).astype(np.float32)
    g[layout.n_params:] = 0.0
    return g


def reference_adam(p, grads, lr, b1, b2, eps, wd, decay):
    """Textbook AdamW on the full vector, float64."""
    p, m, v = p.astype(np.float64), np.zeros(len(p)), np.zeros(len(p))
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * wd * decay * p
        p = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


@pytest.mark.parametrize("wd,chunk", [(0.0, None), (0.1, None), (0.1, 37)])
def test_zero1_equals_plain_adam(dist, wd, chunk, monkeypatch):
    if chunk:  # the update in passes of 37 elements: several per shard, and a shorter last one
        monkeypatch.setattr("capstone.parallel.zero.ADAM_CHUNK", chunk)
    layout = Layout.for_model(CFG, dist.world)
    params = init_params(layout, CFG, 5) if dist.rank == 0 else layout.zeros()
    grads = layout.zeros()
    opt = ZeroAdam(dist.comm, layout, params, grads, (0.9, 0.99), 1e-8, wd)
    start = params.copy()
    assert np.array_equal(start, init_params(layout, CFG, 5)), "parameters were not broadcast from rank 0"
    summed = []
    for step in range(5):
        grads[...] = rank_grad(layout, step, dist.rank)
        stats = opt.reduce_gradients()
        opt.apply(lr=1e-2)
        total = sum(rank_grad(layout, step, r).astype(np.float64) for r in range(dist.world))
        summed.append(total)
        assert stats.norm == pytest.approx(np.linalg.norm(total), rel=1e-5)
    decay = np.zeros(layout.padded)
    for _, shape, off in layout.entries:
        if len(shape) >= 2:
            decay[off:off + int(np.prod(shape))] = 1.0
    want = reference_adam(start, summed, 1e-2, 0.9, 0.99, 1e-8, wd, decay)
    np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)
    every = dist.allgather_json(params.tobytes().hex()[:64] + str(float(params.sum())))
    assert len(set(every)) == 1
    assert opt.optimizer_nbytes() == 12 * layout.padded // dist.world


def test_reduce_gradients_sums_extras_and_carries_nonfinite(dist):
    layout = Layout.for_model(CFG, dist.world)
    params, grads = init_params(layout, CFG, 1), layout.zeros()
    opt = ZeroAdam(dist.comm, layout, params, grads)
    grads[...] = dist.rank + 1.0
    grads[layout.n_params:] = 0.0
    stats = opt.reduce_gradients(extras=[dist.rank, 1.0])
    n = dist.world
    assert stats.extras.tolist() == [n * (n - 1) / 2, n]
    assert stats.norm == pytest.approx(np.sqrt(layout.n_params) * n * (n + 1) / 2, rel=1e-6)
    grads[3] = np.nan if dist.rank == dist.world - 1 else 0.0
    assert not np.isfinite(opt.reduce_gradients().norm)


def test_load_state_rebuilds_identical_params(dist):
    layout = Layout.for_model(CFG, dist.world)
    params, grads = init_params(layout, CFG, 1), layout.zeros()
    opt = ZeroAdam(dist.comm, layout, params, grads)
    shard = np.arange(layout.shard, dtype=np.float32) + dist.rank * layout.shard
    opt.load_state(ShardState(shard, shard * 2, shard * 3, t=7))
    assert np.array_equal(params, np.arange(layout.padded, dtype=np.float32))
    assert opt.state.t == 7 and np.array_equal(opt.state.v, shard * 3)


def test_revert_restores_the_state_before_the_last_update_bit_for_bit(dist):
    """apply writes the new state into the spare arrays: revert brings back the exact state (and
    parameters) of before it, once; a second revert keeps that state; the next apply goes on from it."""
    layout = Layout.for_model(CFG, dist.world)
    params, grads = init_params(layout, CFG, 1), layout.zeros()
    opt = ZeroAdam(dist.comm, layout, params, grads, weight_decay=0.1)
    grads[:layout.n_params] = np.linspace(-1, 1, layout.n_params, dtype=np.float32) * (dist.rank + 1)
    opt.reduce_gradients()
    opt.apply(1e-2)
    before = [a.copy() for a in opt.state.rows()], params.copy(), opt.state.t
    opt.reduce_gradients()
    opt.apply(1e-2, grad_scale=0.5)
    assert not np.array_equal(params, before[1])
    for _ in range(2):
        opt.revert()
        assert all(np.array_equal(a, b) for a, b in zip(opt.state.rows(), before[0]))
        assert np.array_equal(params, before[1]) and opt.state.t == before[2] == 1
    opt.reduce_gradients()
    opt.apply(1e-2, grad_scale=0.5)
    assert opt.state.t == 2 and not np.array_equal(params, before[1])
