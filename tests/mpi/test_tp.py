"""Tensor parallelism under mpirun -n 4: the grid, the conjugate ops f/g and their gradients, the
TP-slice layout, and the TP model's loss and gradients against the 1-rank model's."""

import numpy as np
import pytest
from autograd import make_vjp
from mpi4py import MPI

from capstone.parallel import tensor as tp
from capstone.config import ConfigError, ModelConfig
from capstone.parallel.grid import Grid
from capstone.model.gpt import loss_and_grad
from capstone.model.params import Layout, init_params

CFG = ModelConfig()   # reference: 4 heads, d_model 32
WORLD = MPI.COMM_WORLD.Get_size()
TPS = [k for k in (1, 2, 4) if WORLD % k == 0]


@pytest.mark.parametrize("k", TPS)
def test_grid_groups(k):
    g = Grid.build(MPI.COMM_WORLD, k, CFG)
    rank = MPI.COMM_WORLD.Get_rank()
    assert (g.tp, g.dp, g.tp_rank, g.dp_rank) == (k, WORLD // k, rank % k, rank // k)
    assert g.tp_comm.Get_size() == k and g.dp_comm.Get_size() == WORLD // k
    members = g.tp_comm.allgather(rank)
    assert members == list(range(rank // k * k, rank // k * k + k))   # K consecutive ranks


@pytest.mark.parametrize("k, why", [(3, "does not divide"), (8, "does not divide"), (0, "positive")])
def test_bad_tp_is_a_config_error_on_every_rank(k, why):
    with pytest.raises(ConfigError, match=why):
        Grid.build(MPI.COMM_WORLD, k, CFG)


def test_tp_must_divide_heads():
    if WORLD % 4:
        pytest.skip("needs a world size divisible by 4")
    with pytest.raises(ConfigError, match="n_heads 2"):
        Grid.build(MPI.COMM_WORLD, 4, ModelConfig(n_heads=2, d_model=32))


@pytest.mark.parametrize("k", [k for k in TPS if k > 1])
def test_f_is_identity_forward_allreduce_backward(k):
    g = Grid.build(MPI.COMM_WORLD, k, CFG)
    x = np.arange(6.0).reshape(2, 3)
    vjp, y = make_vjp(lambda a: tp.copy_to_tp(a, g.tp_comm))(x)
    assert np.array_equal(y, x)
    cot = np.full((2, 3), float(g.tp_rank + 1))
    assert np.array_equal(vjp(cot), np.full((2, 3), k * (k + 1) / 2))


@pytest.mark.parametrize("k", [k for k in TPS if k > 1])
def test_g_is_allreduce_forward_identity_backward(k):
    g = Grid.build(MPI.COMM_WORLD, k, CFG)
    x = np.full((2, 3), float(g.tp_rank + 1))
    vjp, y = make_vjp(lambda a: tp.reduce_from_tp(a, g.tp_comm))(x)
    assert np.array_equal(y, np.full((2, 3), k * (k + 1) / 2))
    cot = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(vjp(cot), cot)


@pytest.mark.parametrize("k", [k for k in TPS if k > 1])
def test_f_g_pair_gives_the_full_layer_gradient(k):
    """y = g(gelu(f(x) @ A_t) @ B_t) with A column-split and B row-split: value and d/dx equal the
    unsplit MLP's (float64), the gradient check of the conjugate pair."""
    from capstone.model.kernels import linear, linear_gelu
    g = Grid.build(MPI.COMM_WORLD, k, CFG)
    rng = np.random.default_rng(0)
    x, A, B = rng.standard_normal((5, 8)), rng.standard_normal((8, 16)), rng.standard_normal((16, 8))
    c = rng.standard_normal((5, 8))
    n = 16 // k
    a_t, b_t = A[:, g.tp_rank * n:(g.tp_rank + 1) * n], B[g.tp_rank * n:(g.tp_rank + 1) * n]

    def split(xx):
        u = linear_gelu(tp.copy_to_tp(xx, g.tp_comm), a_t, np.zeros(n))
        return (tp.reduce_from_tp(linear(u, b_t, np.zeros(8)), g.tp_comm) * c).sum()

    def full(xx):
        return (linear(linear_gelu(xx, A, np.zeros(16)), B, np.zeros(8)) * c).sum()

    vjp_s, val_s = make_vjp(split)(x)
    vjp_f, val_f = make_vjp(full)(x)
    assert np.isclose(val_s, val_f, rtol=1e-12)
    assert np.allclose(vjp_s(1.0), vjp_f(1.0), rtol=1e-10, atol=1e-12)
    # and against finite differences of the full function
    e = np.zeros_like(x)
    e[1, 2] = 1e-6
    assert np.isclose(vjp_s(1.0)[1, 2], (full(x + e) - full(x - e)) / 2e-6, rtol=1e-5)


@pytest.mark.parametrize("k", TPS)
def test_slice_layout_and_reassembly(k):
    g = Grid.build(MPI.COMM_WORLD, k, CFG)
    lay = tp.tp_layout(CFG, k, g.dp)
    C, shapes = CFG.d_model, {n: s for n, s, _ in lay.entries}
    assert shapes["h0.attn.c_attn.w"] == (C, 3 * C // k) and shapes["h0.attn.c_attn.b"] == (3 * C // k,)
    assert shapes["h0.attn.c_proj.w"] == (C // k, C) and shapes["h0.attn.c_proj.b"] == (C,)
    assert shapes["h0.mlp.c_fc.w"] == (C, 4 * C // k) and shapes["h0.mlp.c_fc.b"] == (4 * C // k,)
    assert shapes["h0.mlp.c_proj.w"] == (4 * C // k, C) and shapes["wte"] == (CFG.vocab_size, C)
    full_layout = Layout.for_model(CFG, 1)
    full = init_params(full_layout, CFG, 7)
    idx, owned = tp.positions(CFG, k, g.tp_rank)
    mine = tp.slice_params(full, lay, idx)
    # q, k and v of a head travel together: column j*C + h*D of the full c_attn.w
    D = C // CFG.n_heads
    h0 = g.tp_rank * CFG.n_heads // k
    w_full, w_mine = full_layout.views(full)["h0.attn.c_attn.w"], lay.views(mine)["h0.attn.c_attn.w"]
    for j in range(3):
        assert np.array_equal(w_mine[:, j * C // k:j * C // k + D], w_full[:, j * C + h0 * D:j * C + (h0 + 1) * D])
    assert np.array_equal(tp.full_params(g, lay, CFG, mine), full[:full_layout.n_params])
    # every full position is owned by exactly one TP rank
    counts = np.zeros(full_layout.n_params, dtype=np.int64)
    for t in range(k):
        i, o = tp.positions(CFG, k, t)
        np.add.at(counts, i[o], 1)
    assert (counts == 1).all()


@pytest.mark.parametrize("k", [k for k in TPS if k > 1])
def test_tp_model_loss_and_gradient_equal_the_full_model(k):
    g = Grid.build(MPI.COMM_WORLD, k, CFG)
    lay = tp.tp_layout(CFG, k, g.dp)
    full_layout = Layout.for_model(CFG, 1)
    full = init_params(full_layout, CFG, 3)
    idx, _ = tp.positions(CFG, k, g.tp_rank)
    model = tp.TPModel(CFG, lay, tp.slice_params(full, lay, idx), g)
    rng = np.random.default_rng(5 + g.dp_rank)
    x = rng.integers(0, CFG.vocab_size, (3, CFG.seq_len)).astype(np.int32)
    y = rng.integers(0, CFG.vocab_size, (3, CFG.seq_len)).astype(np.int32)
    loss = model.forward_backward([(x, y)], 0.01)
    want, flat = loss_and_grad(full_layout, full, x, y, CFG, 0.01)
    assert np.isclose(loss, want, rtol=1e-6)
    assert np.isclose(model.loss(x, y, 0.01), want, rtol=1e-6)
    got = model.grads[:lay.n_params]
    scale = np.abs(flat).max()
    assert np.abs(got - flat[idx]).max() <= 1e-5 * scale
    # the replicated parameters' gradients are identical (bitwise) on every TP rank
    rep = ~np.isin(np.arange(lay.n_params), np.flatnonzero(tp.positions(CFG, k, 1)[1]))
    everyone = g.tp_comm.allgather(got[rep])
    assert all(np.array_equal(everyone[0], e) for e in everyone)


def _canonical_state(seed=11):
    """Full (1-rank layout) master, m, v vectors: distinct values everywhere."""
    n = Layout.for_model(CFG, 1).n_params
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(3)]


def _checkpointer(k, directory):
    from capstone.parallel.dist import Dist
    from capstone.state import RunIdentity
    from capstone.config import TrainConfig
    g = Grid.build(MPI.COMM_WORLD, k, CFG)
    lay = tp.tp_layout(CFG, k, g.dp)
    identity = RunIdentity(CFG, TrainConfig(), {"test": 1}, 16)
    ck = tp.TPCheckpointer(Dist(MPI.COMM_WORLD), directory, Layout.for_model(CFG, WORLD), identity, g, lay, CFG)
    return g, lay, ck


def _my_shard(g, lay, full):
    from capstone.parallel.zero import ShardState
    idx, _ = tp.positions(CFG, g.tp, g.tp_rank)
    lo, hi = lay.shard_range(g.dp_rank)
    return ShardState(*(tp.slice_params(v, lay, idx)[lo:hi] for v in full), t=5)


def test_checkpoint_digests_do_not_depend_on_the_grid_and_restore_on_any(shared_tmp):
    from capstone.state import RunState
    full = _canonical_state()
    roots = {}
    for k in TPS:
        g, lay, ck = _checkpointer(k, f"{shared_tmp}/tp{k}")
        man = ck.save(RunState(step=3), _my_shard(g, lay, full))
        roots[k] = man["logical_sha256"]
        for k2 in TPS:  # restore on every other grid: exactly the slice and shard that grid needs
            g2, lay2, ck2 = _checkpointer(k2, f"{shared_tmp}/tp{k}")
            state, run_state, meta = ck2.load(man["path"])
            want = _my_shard(g2, lay2, full)
            assert state.t == 5 and run_state.step == 3
            assert all(np.array_equal(a, b) for a, b in zip(state.rows(), want.rows()))
    assert all(r == roots[TPS[0]] for r in roots.values()), roots
