"""--dropout P (capstone.model.dropout): GPT-2's three sites while training, off in evaluation; the mask a
pure function of (seed, step, the sample's index in the step's batch, layer, site, position, channel or
head and key), so every grid trains the 1-rank model: within 1e-5 on 1x4, 2x2, 4x1 ranks x accumulation
and tp 2, bit-identical across 1x4, 2x2, 4x1 with --deterministic. The matrix has a dropout axis."""

import dataclasses

import numpy as np
import pytest

from conftest import mpirun, step_rows

from capstone.config import ConfigError, ModelConfig
from capstone.model.dropout import Draws, Masks
from capstone.model.gpt import Model, loss_sum
from capstone.model.params import Layout, init_params
from capstone.model.seam import Resident

CFG = ModelConfig(vocab_size=13, seq_len=6, d_model=8, n_heads=2, n_layers=2, dropout=0.3)
FLAGS = ("--steps", 4, "--global-batch", 24, "--n-layers", 3, "--dropout", 0.1, "--ckpt-every", 0, "--quiet")
KEYS = ("loss", "grad_norm", "eval_loss", "param_norm")


def micro_batch(cfg, flat, x, y, step=5, rank=0, size=1, micro=0, recompute=False):
    """(loss, gradient) of one micro-batch with the run's dropout masks (`micro`: its index in the step)."""
    layout = Layout.for_model(cfg, 1)
    g = layout.zeros()
    draws = Draws(cfg.dropout, 7, rank, size) if cfg.dropout else None
    model = Model(cfg, layout, Resident.over(layout, flat, g), recompute=recompute, masks=draws)
    model.begin(step)
    if draws is not None:
        draws.micro = micro
    return model.micro_batch(x, y, 1.0, True), g


def data(B=3, seed=0):
    x = np.random.default_rng(seed).integers(0, CFG.vocab_size, (B, CFG.seq_len)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


def params(cfg):
    flat = init_params(Layout.for_model(cfg, 1), cfg, 3)
    return flat + np.random.default_rng(1).normal(0, 0.05, flat.shape).astype(np.float32)


def test_dropout_changes_training_not_evaluation_and_recomputes_the_same_mask():
    flat, (x, y) = params(CFG), data()
    off = dataclasses.replace(CFG, dropout=0.0)
    loss, g = micro_batch(CFG, flat, x, y)
    assert abs(loss - micro_batch(off, flat, x, y)[0]) > 1e-3                       # p > 0 differs from p = 0
    assert loss_sum(Layout.for_model(CFG, 1).groups(flat), x, y, CFG) == loss_sum(
        Layout.for_model(off, 1).groups(flat), x, y, off)                             # evaluation: no dropout
    again, g2 = micro_batch(CFG, flat, x, y, recompute=True)
    assert again == loss and np.array_equal(g, g2)
    assert micro_batch(CFG, flat, x, y, step=6)[0] != loss                            # another step, other masks


def test_the_mask_is_the_samples_whatever_the_micro_batch():
    """Sample s's mask is the same in a micro-batch of 4 rows on one rank as in rank 1's of 2 rows."""
    whole = Masks(0.5, 7, 3, np.arange(4)).channels(2, "attn_out", 6, 8).reshape(4, 6, 8)
    part = Masks(0.5, 7, 3, np.arange(2, 4)).channels(2, "attn_out", 6, 8).reshape(2, 6, 8)
    assert np.array_equal(whole[2:], part) and 0.4 < (whole == 0).mean() < 0.6
    heads = Masks(0.5, 7, 3, np.arange(4)).attention(1, 6, 4, 0)
    assert np.array_equal(heads[:, 2:], Masks(0.5, 7, 3, np.arange(4)).attention(1, 6, 2, 2))   # tp: global heads
    assert not np.array_equal(whole, Masks(0.5, 7, 3, np.arange(4)).channels(2, "mlp_out", 6, 8).reshape(4, 6, 8))


def test_the_gradient_matches_finite_differences():
    flat, (x, y) = params(CFG), data(seed=2)
    _, g = micro_batch(CFG, flat, x, y)
    views, grads = Layout.for_model(CFG, 1).views(flat), Layout.for_model(CFG, 1).views(g)
    for name, i in [("wpe", (2, 3)), ("h0.attn.c_attn.w", (1, 2)), ("h1.attn.c_proj.b", (2,)), ("h1.mlp.c_fc.w", (3, 4))]:
        old, e = views[name][i], 1e-3
        views[name][i] = old + e
        up = micro_batch(CFG, flat, x, y)[0]
        views[name][i] = old - e
        down = micro_batch(CFG, flat, x, y)[0]
        views[name][i] = old
        assert abs((up - down) / (2 * e) - grads[name][i]) < 5e-3 * max(1.0, abs(grads[name][i])), name


def test_a_probability_outside_0_1_is_refused():
    with pytest.raises(ConfigError, match="dropout must be in"):
        dataclasses.replace(CFG, dropout=1.0)


def rows(tmp_path, name, ranks, *flags):
    res = mpirun(ranks, "--out", tmp_path / name, *FLAGS, *flags)
    assert res.returncode == 0, res.stdout + res.stderr
    return step_rows(tmp_path / name)


def test_every_grid_trains_the_one_rank_model(tmp_path):
    one = rows(tmp_path, "one", 1)
    plain = rows(tmp_path, "plain", 1, "--dropout", 0.0)
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(one[1:], plain[1:]))
    for name, ranks, flags in (("1x4", 1, ("--grad-accum", 4)), ("2x2", 2, ("--grad-accum", 2, "--zero-stage", 3)),
                               ("4x1", 4, ("--zero-stage", 2)), ("tp2", 2, ("--tp", 2, "--recompute"))):
        for a, b in zip(rows(tmp_path, name, ranks, *flags), one):
            for key in KEYS:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (name, a["step"], key, a[key], b[key])


def test_deterministic_layouts_are_bit_identical(tmp_path):
    tables = [[{k: r[k] for k in (*KEYS, "fingerprint")} for r in rows(tmp_path, f"det{n}", n, "--deterministic",
                                                                     "--grad-accum", 4 // n)] for n in (1, 2, 4)]
    assert tables[0] == tables[1] == tables[2]


def test_the_peak_with_dropout_is_the_peak_without_it_plus_the_masks():
    """Issue 48: dropout is an input of the one block, not a copy of it (the copy had stopped freeing the
    MLP's activations early): a training micro-batch's peak with --dropout exceeds the peak without it
    by the masks the blocks keep, 2 C + H T floats per position per block (one block with --recompute),
    and the preflight's formula adds exactly those."""
    import tracemalloc
    from capstone.config import TrainConfig
    from capstone.runtime.preflight import activation_bytes
    cfg, B = ModelConfig(vocab_size=64, seq_len=64, d_model=64, n_heads=4, n_layers=4), 8
    x = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, cfg.seq_len)).astype(np.int32)

    def peak(c, recompute):
        layout = Layout.for_model(c, 1)
        model = Model(c, layout, Resident.over(layout, init_params(layout, c, 3), layout.zeros()),
                      recompute=recompute, masks=Draws(c.dropout, 7, 0, 1) if c.dropout else None)
        model.micro_batch(x, np.roll(x, -1, 1), 1.0, True)      # the caches warm
        tracemalloc.start()
        try:
            model.micro_batch(x, np.roll(x, -1, 1), 1.0, True)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    on = dataclasses.replace(cfg, dropout=0.1)
    for recompute in (False, True):
        masks = 4 * B * cfg.seq_len * (2 * cfg.d_model + cfg.n_heads * cfg.seq_len) * (1 if recompute else cfg.n_layers)
        extra = peak(on, recompute) - peak(cfg, recompute)
        assert 0.75 * masks <= extra <= masks, (recompute, extra, masks)
        tcfg = TrainConfig(batch_size=B)
        assert activation_bytes(on, tcfg, recompute) - activation_bytes(cfg, tcfg, recompute) == masks
