"""Tensor parallelism under mpirun -n 4: the grid's groups, the split block's forward and backward
(the conjugate f/g sums inside it) against the whole model's in float64, the slice layout and its
reassembly, and grid-independent checkpoints."""

import numpy as np
import pytest
from mpi4py import MPI

from capstone.checkpoint.cadence import Cadence
from capstone.checkpoint.saver import Checkpointer, RunIdentity
from capstone.config import ConfigError, ModelConfig, TrainConfig
from capstone.model.gpt import loss_and_grad, loss_sum
from capstone.model.params import Layout, init_params
from capstone.parallel import tensor as tp
from capstone.parallel.canonical import Canonical
from capstone.collective.comm import Comm
from capstone.parallel.grid import Grid
from capstone.plan import Plan
from capstone.step.state import ShardState
from capstone.step.state import RunState

CFG = ModelConfig()   # reference: 4 heads, d_model 32
WORLD = MPI.COMM_WORLD.Get_size()
TPS = [k for k in (1, 2, 4) if WORLD % k == 0]


def grid(k: int) -> Grid:
    return Grid.build(Comm(MPI.COMM_WORLD), Plan(world=WORLD, tp=k))


@pytest.mark.parametrize("k", TPS)
def test_grid_groups(k):
    g = grid(k)
    rank = MPI.COMM_WORLD.Get_rank()
    assert g.shape == (WORLD // k, 1, k) and (g.tp.rank, g.dp.rank, g.pp.rank) == (rank % k, rank // k, 0)
    members = np.empty(k, dtype=np.int64)
    g.tp.Allgather(members, "test", send=np.array([rank], dtype=np.int64))
    assert members.tolist() == list(range(rank // k * k, rank // k * k + k))   # K consecutive ranks
    same = np.empty(WORLD // k, dtype=np.int64)
    g.dp.Allgather(same, "test", send=np.array([rank], dtype=np.int64))
    assert same.tolist() == list(range(rank % k, WORLD, k))                     # one per replica


@pytest.mark.parametrize("k, why", [(3, "does not divide"), (8, "does not divide"), (0, "positive")])
def test_bad_tp_is_a_config_error_on_every_rank(k, why):
    with pytest.raises(ConfigError, match=why):
        Plan.make(model=CFG, train=TrainConfig(), world=4, given={"tp": k})


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match="n_heads 2"):
        Plan.make(model=ModelConfig(n_heads=2, d_model=32), train=TrainConfig(), world=4, given={"tp": 4})


def _split_model(g: Grid, dtype, seed: int = 3):
    """(whole parameters, this rank's slice, its layout) of the model, as `dtype`."""
    full_layout = Layout.for_model(CFG, 1)
    full = init_params(full_layout, CFG, seed).astype(dtype)
    full[:full_layout.n_params] += np.random.default_rng(seed).standard_normal(full_layout.n_params) * 0.05
    lay = Layout.for_model(CFG, g.dp.size, g.tp.size)
    mine = np.zeros(lay.padded, dtype=dtype)
    mine[:lay.n_params] = full[tp.positions(CFG, g.tp.size, g.tp.rank)[0]]
    return full_layout, full, lay, mine


@pytest.mark.parametrize("k", [k for k in TPS if k > 1])
def test_split_model_loss_and_gradient_equal_the_whole_model_float64(k):
    """The conjugate pair inside the block: g (sum of the row-parallel outputs) forward, f (sum of
    the column-parallel input gradients) backward. In float64 the split model's loss and every
    gradient equal the whole model's to 1e-10: a missing or doubled sum is far outside."""
    g = grid(k)
    full_layout, full, lay, mine = _split_model(g, np.float64)
    rng = np.random.default_rng(5 + g.dp.rank)
    x = rng.integers(0, CFG.vocab_size, (3, CFG.seq_len))
    y = rng.integers(0, CFG.vocab_size, (3, CFG.seq_len))
    loss, grads = loss_and_grad(lay, mine, x, y, CFG, 0.01, g.tp)
    want, flat = loss_and_grad(full_layout, full, x, y, CFG, 0.01)
    assert abs(loss - want) <= 1e-12 * abs(want)
    idx = tp.positions(CFG, k, g.tp.rank)[0]
    assert np.abs(grads[:lay.n_params] - flat[idx]).max() <= 1e-10 * np.abs(flat).max()


@pytest.mark.parametrize("k", [k for k in TPS if k > 1])
def test_split_model_float32_and_replicated_gradients_identical_on_every_tp_rank(k):
    from capstone.model.gpt import Model
    g = grid(k)
    full_layout, full, lay, mine = _split_model(g, np.float32)
    model = Model.over(CFG, lay, mine, g.tp)
    rng = np.random.default_rng(5 + g.dp.rank)
    x = rng.integers(0, CFG.vocab_size, (3, CFG.seq_len)).astype(np.int32)
    y = rng.integers(0, CFG.vocab_size, (3, CFG.seq_len)).astype(np.int32)
    loss = model.forward_backward([(x, y)], 0.01)
    want, flat = loss_and_grad(full_layout, full, x, y, CFG, 0.01)
    assert np.isclose(loss, want, rtol=1e-6) and np.isclose(model.loss(x, y, 0.01), want, rtol=1e-6)
    idx, owned = tp.positions(CFG, k, g.tp.rank)
    assert np.abs(model.grads[:lay.n_params] - flat[idx]).max() <= 1e-5 * np.abs(flat).max()
    whole = tp.positions(CFG, k, 1)[1]   # False where a rank > 0 holds a whole (replicated) parameter
    everyone = np.empty((k, int((~whole).sum())), dtype=np.float32)
    g.tp.Allgather(everyone, "test", send=np.ascontiguousarray(model.grads[:lay.n_params][~whole]))
    assert all(np.array_equal(everyone[0], e) for e in everyone)


@pytest.mark.parametrize("k", TPS)
def test_slice_layout_and_reassembly(k):
    g = grid(k)
    lay = Layout.for_model(CFG, g.dp.size, k)
    C, shapes = CFG.d_model, {n: s for n, s, _ in lay.entries}
    assert shapes["h0.attn.c_attn.w"] == (C, 3 * C // k) and shapes["h0.attn.c_attn.b"] == (3 * C // k,)
    assert shapes["h0.attn.c_proj.w"] == (C // k, C) and shapes["h0.attn.c_proj.b"] == (C,)
    assert shapes["h0.mlp.c_fc.w"] == (C, 4 * C // k) and shapes["h0.mlp.c_fc.b"] == (4 * C // k,)
    assert shapes["h0.mlp.c_proj.w"] == (4 * C // k, C) and shapes["wte"] == (CFG.vocab_size, C)
    full_layout = Layout.for_model(CFG, 1)
    full = init_params(full_layout, CFG, 7)
    mine = tp.initial_params(CFG, lay, 7, k, g.tp.rank)
    # q, k and v of a head travel together: column j*C + h*D of the full c_attn.w
    D = C // CFG.n_heads
    h0 = g.tp.rank * CFG.n_heads // k
    w_full, w_mine = full_layout.views(full)["h0.attn.c_attn.w"], lay.views(mine)["h0.attn.c_attn.w"]
    for j in range(3):
        assert np.array_equal(w_mine[:, j * C // k:j * C // k + D], w_full[:, j * C + h0 * D:j * C + (h0 + 1) * D])
    view = Canonical(g, CFG, lay, Layout.for_model(CFG, WORLD), [None])
    assert np.array_equal(view.whole(mine), full[:full_layout.n_params])
    counts = np.zeros(full_layout.n_params, dtype=np.int64)   # every full position owned by one TP rank
    for t in range(k):
        i, o = tp.positions(CFG, k, t)
        np.add.at(counts, i[o], 1)
    assert (counts == 1).all()


def _checkpointer(k, directory):
    g = grid(k)
    lay, full = Layout.for_model(CFG, g.dp.size, k), Layout.for_model(CFG, WORLD)
    identity = RunIdentity(CFG, TrainConfig(), {"test": 1}, 16)
    return g, lay, Checkpointer(g.world, directory, full, identity, Cadence(identity.train, g.world.rank),
                                Canonical(g, CFG, lay, full, [None]))


def _my_shard(g, lay, full):
    idx, _ = tp.positions(CFG, g.tp.size, g.tp.rank)
    lo, hi = lay.shard_range(g.dp.rank)
    rows = []
    for v in full:
        mine = lay.zeros()
        mine[:lay.n_params] = v[idx]
        rows.append(mine[lo:hi])
    return ShardState(*rows, t=5)


def test_checkpoint_digests_do_not_depend_on_the_grid_and_restore_on_any(shared_tmp):
    n = Layout.for_model(CFG, 1).n_params
    full = [np.random.default_rng(11 + i).standard_normal(n).astype(np.float32) for i in range(3)]
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
