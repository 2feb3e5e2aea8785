"""--tie-embeddings (capstone.model.tied): the LM head is wte. The tied model is the untied one whose
head is held equal to wte.T: the same loss and logits, and wte's gradient the sum of the untied
model's two gradients (its embedding's and its head's, transposed). The rows of the composition
matrix with a tie (tests/composition.py) run it over every grid against one rank."""

import dataclasses

import numpy as np
import pytest
from conftest import mpirun, step_rows

from capstone.config import ModelConfig
from capstone.gpt2.generate import KVCache
from capstone.model.gpt import logits, loss_and_grad
from capstone.model.params import Layout, init_params

CFG = ModelConfig(vocab_size=13, seq_len=6, d_model=8, n_heads=2, n_layers=2, tie_embeddings=True)


def pair(head_bias: bool, seed: int = 4):
    """(tied config, layout, params; untied config, layout, params with lm_head.w = wte.T)."""
    tied = dataclasses.replace(CFG, head_bias=head_bias)
    untied = dataclasses.replace(tied, tie_embeddings=False)
    lt, lu = Layout.for_model(tied, 1), Layout.for_model(untied, 1)
    pt = init_params(lt, tied, seed)
    pt += np.random.default_rng(seed).normal(0, 0.05, pt.shape).astype(np.float32)   # non-trivial LN and bias
    pu = lu.zeros()
    vt, vu = lt.views(pt), lu.views(pu)
    for name, a in vt.items():
        vu[name][...] = a
    vu["lm_head.w"][...] = vt["wte"].T
    return (tied, lt, pt), (untied, lu, pu)


def batch(cfg, B=3, seed=0):
    x = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(B, cfg.seq_len)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


@pytest.mark.parametrize("head_bias", [False, True])
def test_the_tied_gradient_of_wte_is_the_sum_of_both_uses(head_bias):
    (tc, lt, pt), (uc, lu, pu) = pair(head_bias)
    assert lu.n_params - lt.n_params == CFG.vocab_size * CFG.d_model and "lm_head.w" not in lt.views(pt)
    x, y = batch(tc)
    loss_t, gt = loss_and_grad(lt, pt, x, y, tc, 0.1)
    loss_u, gu = loss_and_grad(lu, pu, x, y, uc, 0.1)
    assert np.isclose(loss_t, loss_u, rtol=1e-6)
    vt, vu = lt.views(gt), lu.views(gu)
    summed = vu["wte"] + vu["lm_head.w"].T
    assert np.abs(vu["lm_head.w"]).max() > 1e-3 and np.abs(vu["wte"]).max() > 1e-3   # both uses count
    np.testing.assert_allclose(vt["wte"], summed, rtol=1e-5, atol=1e-7)
    for name in vt:
        if name != "wte":
            np.testing.assert_allclose(vt[name], vu[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_the_tied_gradient_matches_finite_differences():
    (tc, lt, pt), _ = pair(False)
    x, y = batch(tc, seed=2)
    _, g = loss_and_grad(lt, pt.astype(np.float32), x, y, tc, 1.0)
    wte, gw = lt.views(pt)["wte"], lt.views(g)["wte"]
    for i, j in [(int(x[0, 0]), 1), (int(y[1, 2]), 5), (12, 0)]:
        old, e = wte[i, j], 1e-2
        wte[i, j] = old + e
        up = loss_and_grad(lt, pt, x, y, tc, 1.0)[0]
        wte[i, j] = old - e
        down = loss_and_grad(lt, pt, x, y, tc, 1.0)[0]
        wte[i, j] = old
        assert abs((up - down) / (2 * e) - gw[i, j]) < 2e-3 * max(1.0, abs(gw[i, j])), (i, j)


def test_tied_logits_and_the_kv_cache_read_wte():
    (tc, lt, pt), (uc, lu, pu) = pair(True)
    x, _ = batch(tc, B=1)
    want = logits(lu.groups(pu), x, uc)
    got = logits(lt.groups(pt), x, tc)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    cached = KVCache(lt.views(pt), tc).forward(x[0].tolist())
    np.testing.assert_allclose(cached, want, rtol=1e-4, atol=1e-5)


def test_a_tied_pipeline_sums_wte_between_its_first_and_last_stages_and_resumes_on_one_rank(tmp_path):
    """--pp 2 with a tied head at ZeRO-3 on 4 ranks (dp 2): every step's loss, gradient norm and
    parameter norm equal the 1-rank run's within 1e-5; stopped at step 2, its canonical checkpoint
    (one wte) resumes on one rank, untied from the pipeline, and ends as the 1-rank run."""
    flags = ["--steps", 4, "--n-layers", 2, "--global-batch", 8, "--tie-embeddings", "--lr", "3e-3", "--quiet",
             "--ckpt-every", 2]
    one = mpirun(1, "--out", tmp_path / "one", *flags)
    assert one.returncode == 0, one.stderr[-2000:]
    pp = mpirun(4, "--out", tmp_path / "pp", *flags, "--pp", 2, "--zero-stage", 3, "--grad-accum", 2,
                "--stop-after", 2)
    assert pp.returncode == 0, pp.stderr[-2000:]
    back = mpirun(1, "--out", tmp_path / "pp", *flags, "--resume", "latest")
    assert back.returncode == 0, back.stderr[-2000:]
    want, got = step_rows(tmp_path / "one"), step_rows(tmp_path / "pp")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "param_norm", "eval_loss"):
            assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]), (g["step"], key, g[key], w[key])
