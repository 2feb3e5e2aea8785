"""MiniGPT: gradients against finite differences (float64) and float32 all through the backward pass."""

import autograd.core
import numpy as np
import pytest

from capstone.config import ConfigError, ModelConfig
from capstone.data import DataStream, make_corpus
from capstone.model import loss_and_grad, loss_sum
from capstone.params import Layout, init_params

CFG = ModelConfig(vocab_size=11, seq_len=5, d_model=8, n_heads=2, n_layers=2)


def batch(cfg, B=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab_size, size=(B, cfg.seq_len))
    return x, np.roll(x, -1, axis=1)


def params64(cfg, seed=3):
    layout = Layout.for_model(cfg, 1)
    flat = init_params(layout, cfg, seed).astype(np.float64)
    flat += np.random.default_rng(seed).normal(0, 0.05, flat.shape)  # non-trivial LN weights and biases
    return layout, flat


def test_gradient_matches_finite_differences_float64():
    layout, flat = params64(CFG)
    x, y = batch(CFG)
    _, grads = loss_and_grad(layout.views(flat), x, y, CFG, 1.0 / x.size)
    rng = np.random.default_rng(7)
    checked = 0
    for name, shape, off in layout.entries:
        size = int(np.prod(shape))
        for i in rng.choice(size, size=min(3, size), replace=False):
            h = 1e-6
            plus, minus = flat.copy(), flat.copy()
            plus[off + i] += h
            minus[off + i] -= h
            fd = (loss_sum(layout.views(plus), x, y, CFG, 1.0 / x.size) -
                  loss_sum(layout.views(minus), x, y, CFG, 1.0 / x.size)) / (2 * h)
            analytic = grads[name].reshape(-1)[i]
            assert abs(fd - analytic) <= 1e-7 + 1e-5 * abs(fd), (name, i, fd, analytic)
            checked += 1
    assert checked > 3 * len(layout.entries) - 5


def test_every_backward_gradient_is_float32(monkeypatch):
    """Record the dtype of every gradient that flows through every VJP of the backward pass."""
    seen = []
    original = autograd.core.VJPNode.__init__

    def recording_init(self, value, fun, args, kwargs, parent_argnums, parents):
        original(self, value, fun, args, kwargs, parent_argnums, parents)
        vjp, name = self.vjp, getattr(fun, "__name__", str(fun))

        def leaves(item):
            if isinstance(item, dict):
                for v in item.values():
                    yield from leaves(v)
            elif isinstance(item, (list, tuple)):
                for v in item:
                    yield from leaves(v)
            elif item is not None and not isinstance(item, autograd.core.SparseObject):
                yield np.asarray(item)  # SparseObject: a lazy scatter of an already-checked gradient

        def wrapped(g):
            out = vjp(g)
            for leaf in leaves(list(out)):
                seen.append((name, leaf.dtype))
            return out
        self.vjp = wrapped

    monkeypatch.setattr(autograd.core.VJPNode, "__init__", recording_init)
    cfg = ModelConfig()
    layout = Layout.for_model(cfg, 1)
    x, y = batch(cfg, B=2)
    loss, grads = loss_and_grad(layout.views(init_params(layout, cfg, 0)), x, y, cfg, 1.0 / x.size)
    assert len(seen) > 100
    wrong = sorted({(n, str(d)) for n, d in seen if d != np.float32})
    assert not wrong, f"VJPs producing non-float32 gradients: {wrong}"
    assert all(g.dtype == np.float32 for g in grads.values())


def test_initial_loss_is_near_uniform_and_learnable_corpus():
    cfg = ModelConfig()
    layout = Layout.for_model(cfg, 1)
    stream = DataStream(make_corpus(0, 1 << 14, cfg.vocab_size), cfg.seq_len, 8, seed=1)
    x, y = stream.samples(0, 8)
    loss = float(loss_sum(layout.views(init_params(layout, cfg, 0)), x, y, cfg, 1.0 / x.size))
    assert abs(loss - np.log(cfg.vocab_size)) < 0.05


def test_layout_views_share_the_buffer_and_pad_to_world():
    cfg = ModelConfig()
    for world in (1, 2, 3, 4, 5, 7, 8):
        layout = Layout.for_model(cfg, world)
        assert layout.padded % world == 0 and 0 <= layout.padded - layout.n_params < world
    layout = Layout.for_model(cfg, 7)
    flat = layout.zeros()
    views = layout.views(flat)
    views["lm_head.b"][...] = 2.0
    assert flat[layout.n_params - cfg.vocab_size:layout.n_params].sum() == 2.0 * cfg.vocab_size
    assert flat[layout.n_params:].sum() == 0.0
    assert sum(v.size for v in views.values()) == layout.n_params


def test_bad_model_config_says_what_to_do():
    with pytest.raises(ConfigError, match="divisible by n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="positive integer"):
        ModelConfig(n_layers=0)
