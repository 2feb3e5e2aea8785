"""--no-bias (nanoGPT's bias=False): no biases in the blocks' linear layers, their LayerNorms and ln_f.
The model without biases is the biased one whose biases are held at zero: the same weights from the
same seed, the same loss, logits and KV-cache logits, and the same gradient of every weight. The rows
of the composition matrix without biases (tests/composition.py) run it over every grid against one
rank; tests/test_export.py takes it to transformers."""

import dataclasses

import numpy as np
import pytest
from conftest import mpirun, step_rows

from capstone.config import ModelConfig
from capstone.gpt2.generate import KVCache
from capstone.model.gpt import logits, loss_and_grad
from capstone.model.params import Layout, init_params
from capstone.flags.presets import PRESETS

CFG = ModelConfig(vocab_size=13, seq_len=6, d_model=8, n_heads=2, n_layers=2, bias=False)


def pair(cfg: ModelConfig, seed: int = 4):
    """(config, layout, params without biases; the same with biases, held at zero)."""
    biased = dataclasses.replace(cfg, bias=True)
    ln, lb = Layout.for_model(cfg, 1), Layout.for_model(biased, 1)
    pn = init_params(ln, cfg, seed)
    pn += np.random.default_rng(seed).normal(0, 0.05, pn.shape).astype(np.float32)   # non-trivial LayerNorms
    pb = lb.zeros()
    vb = lb.views(pb)
    for name, a in ln.views(pn).items():
        vb[name][...] = a
    return (cfg, ln, pn), (biased, lb, pb)


def batch(cfg, B=3, seed=0):
    x = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(B, cfg.seq_len)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


@pytest.mark.parametrize("tie,head_bias", [(False, True), (True, False)])
def test_the_layout_has_no_bias_and_the_same_seed_draws_the_same_weights(tie, head_bias):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, head_bias=head_bias)
    (_, ln, _), (biased, lb, _) = pair(cfg)
    names = [name for name, _, _ in ln.entries]
    assert [n for n in names if n.endswith(".b")] == ["lm_head.b"] * head_bias, names
    C, L = cfg.d_model, cfg.n_layers
    # ln_1, c_attn, c_proj, ln_2, c_fc, c_proj of each block, and ln_f
    assert lb.n_params - ln.n_params == L * (C + 3 * C + C + C + 4 * C + C) + C
    vn, vb = ln.views(init_params(ln, cfg, 7)), lb.views(init_params(lb, biased, 7))
    for name, a in vn.items():
        np.testing.assert_array_equal(a, vb[name], err_msg=name)


@pytest.mark.parametrize("tie", [False, True])
def test_the_loss_and_every_weights_gradient_are_the_biased_models_at_zero_bias(tie):
    (cfg, ln, pn), (biased, lb, pb) = pair(dataclasses.replace(CFG, tie_embeddings=tie, head_bias=not tie))
    x, y = batch(cfg)
    loss_n, gn = loss_and_grad(ln, pn, x, y, cfg, 0.1)
    loss_b, gb = loss_and_grad(lb, pb, x, y, biased, 0.1)
    assert loss_n == loss_b     # the same arithmetic: adding a zero bias changes no bit
    vn, vb = ln.views(gn), lb.views(gb)
    assert max(np.abs(vb[n]).max() for n in vb if n.endswith(".b") and n not in vn) > 1e-3   # the biases would move
    for name in vn:
        np.testing.assert_allclose(vn[name], vb[name], rtol=1e-6, atol=1e-8, err_msg=name)


def test_logits_and_the_kv_cache_without_biases():
    (cfg, ln, pn), (biased, lb, pb) = pair(CFG)
    x, _ = batch(cfg, B=1)
    want = logits(lb.groups(pb), x, biased)
    np.testing.assert_allclose(logits(ln.groups(pn), x, cfg), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(KVCache(ln.views(pn), cfg).forward(x[0].tolist()), want, rtol=1e-4, atol=1e-5)


def test_the_shakespeare_char_preset_is_nanogpts_model():
    """nanoGPT's train.py: bias=False, its lm_head tied to wte and without a bias."""
    preset = PRESETS["shakespeare-char"]
    assert (preset["bias"], preset["head_bias"], preset["tie_embeddings"]) == (False, False, True)


def test_a_run_without_biases_resumes_and_refuses_a_biased_resume(tmp_path):
    """Trained 3 steps on 2 ranks with tp 2 and ZeRO-3, stopped, resumed on 1 rank to the same losses
    as the run left alone; --bias on resume contradicts the checkpoint's model."""
    flags = ["--steps", 6, "--global-batch", 8, "--no-bias", "--quiet", "--ckpt-every", 3]
    alone, run = tmp_path / "alone", tmp_path / "run"
    assert mpirun(2, "--out", alone, *flags, "--tp", 2, "--zero-stage", 3).returncode == 0
    assert mpirun(2, "--out", run, *flags, "--stop-after", 3).returncode == 0
    res = mpirun(1, "--out", run, "--resume", "latest")
    assert res.returncode == 0, res.stdout + res.stderr
    got, want = step_rows(run), step_rows(alone)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6] == [r["step"] for r in want]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=2e-5)
    res = mpirun(1, "--out", run, "--resume", "latest", "--bias", "--steps", 8)
    assert res.returncode == 2 and "bias" in res.stderr, res.stdout + res.stderr


@pytest.mark.parametrize("flags", [{}, {"bias": False, "head_bias": False, "tie_embeddings": True}],
                         ids=["gpt2", "nanogpt"])
def test_the_pytorch_twin_has_capstones_loss_and_gradient(flags):
    """benchmarks/torch_model.py (the model of scripts/bench-shakespeare's PyTorch reference and of the
    speed bench against torch) is capstone's model with or without biases and tie: the same loss and
    gradient from the same parameters (torch in its own venv: scripts/torch-venv)."""
    from test_export import torch_python

    from benchmarks.torch_worker import TorchWorker
    cfg = dataclasses.replace(CFG, **{"bias": True, "d_model": 16, **flags})
    layout = Layout.for_model(cfg, 1)
    params = init_params(layout, cfg, 5)
    params += np.random.default_rng(5).normal(0, 0.05, params.shape).astype(np.float32)
    x, y = batch(cfg, B=4, seed=3)
    opt = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1, "clip": 1.0}
    twin = TorchWorker(torch_python(), cfg, layout, params, (x, y), opt)
    try:
        loss_t, grad_t = twin.grads()
    finally:
        twin.close()
    loss, grad = loss_and_grad(layout, params, x, y, cfg, 1.0 / x.size)
    assert abs(loss_t - loss) < 1e-5 * abs(loss)
    np.testing.assert_allclose(grad_t[:layout.n_params], grad[:layout.n_params], rtol=1e-3, atol=2e-6)
