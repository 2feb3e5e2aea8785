"""MiniGPT: gradients against finite differences (float64), float32 all through the backward pass,
each hand-written VJP of capstone.kernels checked on its own, and the model against a composed
autograd.numpy reference (the implementation the kernels replaced)."""

import dataclasses
import math

import autograd
import autograd.core
import autograd.numpy as anp
import numpy as np
import pytest
from autograd.core import primitive_vjps
from autograd.tracer import getval

from capstone.config import ConfigError, ModelConfig
from capstone.data.synthetic import DataStream, make_corpus
from capstone.model import blocks, kernels
from capstone.model.blocks import ALONE
from capstone.model.gpt import logits, loss_and_grad, loss_sum
from capstone.model.kernels import causal_mask
from capstone.model.ops import causal_attention, cross_entropy_sum, embed, gelu, layer_norm, linear, linear_gelu
from capstone.model.params import Layout, group_shapes, init_params

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


# ---- reference: plain composed autograd.numpy (slow, obviously right) ----------------------------

def ref_layer_norm(x, w, b, eps=1e-5):
    mu = anp.sum(x, axis=-1, keepdims=True) * (1.0 / x.shape[-1])
    xc = x - mu
    var = anp.sum(xc * xc, axis=-1, keepdims=True) * (1.0 / x.shape[-1])
    return xc / anp.sqrt(var + eps) * w + b


def ref_gelu(x):
    return 0.5 * x * (1.0 + anp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def ref_attention(qkv, T, H):
    """qkv (B*T, 3C) -> (B*T, C), causal softmax attention per head."""
    N, C = qkv.shape[0], qkv.shape[1] // 3
    B, D = N // T, C // H
    qkv = anp.transpose(anp.reshape(qkv, (B, T, 3, H, D)), (2, 0, 3, 1, 4))  # (3, B, H, T, D)
    att = anp.matmul(qkv[0], anp.swapaxes(qkv[1], -1, -2)) * (1.0 / math.sqrt(D)) + causal_mask(T)
    e = anp.exp(att - np.max(getval(att), axis=-1, keepdims=True))
    y = anp.matmul(e / anp.sum(e, axis=-1, keepdims=True), qkv[2])           # (B, H, T, D)
    return anp.reshape(anp.transpose(y, (0, 2, 1, 3)), (N, C))


def ref_cross_entropy_sum(z, targets):
    z = z - np.max(getval(z), axis=1, keepdims=True)
    logp = z - anp.log(anp.sum(anp.exp(z), axis=1, keepdims=True))
    onehot = np.zeros(z.shape, dtype=np.float32)
    onehot[np.arange(z.shape[0]), targets] = 1.0
    return -anp.sum(logp * onehot)


def ref_logits(p, idx, cfg):
    B, T = idx.shape
    lin = lambda x, name: anp.dot(x, p[name + ".w"]) + p[name + ".b"]  # noqa: E731
    x = anp.reshape(p["wte"][idx] + p["wpe"][:T], (B * T, cfg.d_model))
    for i in range(cfg.n_layers):
        h = f"h{i}."
        qkv = lin(ref_layer_norm(x, p[h + "ln_1.w"], p[h + "ln_1.b"]), h + "attn.c_attn")
        x = x + lin(ref_attention(qkv, T, cfg.n_heads), h + "attn.c_proj")
        u = ref_gelu(lin(ref_layer_norm(x, p[h + "ln_2.w"], p[h + "ln_2.b"]), h + "mlp.c_fc"))
        x = x + lin(u, h + "mlp.c_proj")
    return lin(ref_layer_norm(x, p["ln_f.w"], p["ln_f.b"]), "lm_head")                 # (B*T, V)


def ref_loss_sum(p, idx, targets, cfg, scale=1.0):
    return ref_cross_entropy_sum(ref_logits(p, idx, cfg), targets.reshape(-1)) * scale


# ---- the whole model ----------------------------------------------------------------------------

@pytest.mark.parametrize("head_bias", [True, False])
def test_gradient_matches_finite_differences_float64(head_bias):
    cfg = dataclasses.replace(CFG, head_bias=head_bias)
    layout, flat = params64(cfg)
    assert ("lm_head.b" in layout.views(flat)) == head_bias     # --no-head-bias: GPT-2's head, no bias
    x, y = batch(cfg)
    grads = layout.views(loss_and_grad(layout, flat, x, y, cfg, 1.0 / x.size)[1])
    rng = np.random.default_rng(7)
    checked = 0
    for name, shape, off in layout.entries:
        size = int(np.prod(shape))
        for i in rng.choice(size, size=min(3, size), replace=False):
            h = 1e-6
            plus, minus = flat.copy(), flat.copy()
            plus[off + i] += h
            minus[off + i] -= h
            fd = (loss_sum(layout.groups(plus), x, y, cfg, 1.0 / x.size) -
                  loss_sum(layout.groups(minus), x, y, cfg, 1.0 / x.size)) / (2 * h)
            analytic = grads[name].reshape(-1)[i]
            assert abs(fd - analytic) <= 1e-7 + 1e-5 * abs(fd), (name, i, fd, analytic)
            checked += 1
    assert checked > 3 * len(layout.entries) - 5


@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-10), (np.float32, 1e-5)])
def test_fast_path_matches_composed_reference(dtype, rtol):
    cfg = ModelConfig()
    layout, flat = params64(cfg)
    flat = flat.astype(dtype)
    p = layout.views(flat)
    x, y = batch(cfg, B=4)
    loss, g = loss_and_grad(layout, flat, x, y, cfg, 1.0 / x.size)
    grads = layout.views(g)
    ref_loss, ref_grads = autograd.value_and_grad(ref_loss_sum)(p, x, y, cfg, 1.0 / x.size)
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss)
    np.testing.assert_allclose(logits(layout.groups(flat), x, cfg), ref_logits(p, x, cfg), rtol=rtol, atol=rtol)
    for name, g in grads.items():
        assert g.dtype == dtype and g.shape == p[name].shape, name
        np.testing.assert_allclose(g, ref_grads[name], rtol=rtol, atol=rtol * np.abs(ref_grads[name]).max(),
                                   err_msg=name)


# The fused parts (capstone.model.blocks' pairs) as plain autograd primitives of their input and
# their group, which is how autograd would differentiate them if the group were a graph input.
def _pair_vjp(backward, n_inputs, shapes_at):
    def vjp(g, saved, argnums, *args):
        gw = np.empty_like(args[n_inputs])
        d = blocks.unpack(gw, args[shapes_at])
        gx = backward(g, list(saved) if saved else saved, lambda op, *operands: op(d, *operands), *args)
        return {n_inputs: gw, **({0: gx} if n_inputs else {})}
    return vjp


embedding = kernels.define("embedding_of_w", lambda w, idx, shapes: blocks.embedding_forward(w, idx, shapes),
                           _pair_vjp(lambda g, saved, gw, w, idx, shapes: blocks.embedding_backward(g, w, idx, shapes, gw),
                                     0, -1))
block = kernels.define("block_of_xw", blocks.block_forward, _pair_vjp(
    lambda g, saved, gw, x, w, T, H, shapes, tp: blocks.block_backward(g, saved, x, w, T, H, shapes, tp, gw, False), 1, -2))
head_loss = kernels.define("head_loss_of_xw", blocks.head_loss_forward, _pair_vjp(
    lambda g, saved, gw, x, w, t, shapes: blocks.head_loss_backward(g, saved, w, t, shapes, gw, False), 1, -1))


def composed_loss(groups, idx, targets, cfg, scale):
    """The model composed from those primitives, each group an input of the autograd graph."""
    shapes, H = group_shapes(cfg), cfg.n_heads
    x = embedding(groups["embed"], idx, shapes["embed"])
    for i in range(cfg.n_layers):
        x = block(x, groups[f"h{i}"], idx.shape[1], H, shapes[f"h{i}"], ALONE)
    return head_loss(x, groups["head"], targets.reshape(-1), shapes["head"]) * scale


def test_the_one_backward_driver_equals_autograd_through_the_groups():
    """The seam's driver (weights fetched by name, gradients landing in the buffer) gives the bits
    of plain autograd with every group an input of the graph."""
    layout, flat = params64(ModelConfig())
    flat = flat.astype(np.float32)
    x, y = batch(ModelConfig(), B=2)
    loss, g = loss_and_grad(layout, flat, x, y, ModelConfig(), 0.25)
    grads = layout.groups(g)
    loss2, grads2 = autograd.value_and_grad(composed_loss)(layout.groups(flat), x, y, ModelConfig(), 0.25)
    assert loss == float(loss2) and grads.keys() == grads2.keys() == {"embed", "h0", "h1", "head"}
    for name in grads:
        np.testing.assert_array_equal(grads[name], grads2[name], err_msg=name)


# ---- float32 through every VJP ------------------------------------------------------------------

@pytest.fixture
def vjp_dtypes(monkeypatch):
    """[(primitive name, dtype)] of every gradient that flows out of every VJP while the test runs."""
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
            out = tuple(vjp(g))  # a VJP may return a generator: record it and hand on a tuple
            for leaf in leaves(out):
                seen.append((name, leaf.dtype))
            return out
        self.vjp = wrapped

    monkeypatch.setattr(autograd.core.VJPNode, "__init__", recording_init)
    return seen


def test_every_backward_gradient_is_float32(vjp_dtypes):
    cfg = ModelConfig()
    layout = Layout.for_model(cfg, 1)
    x, y = batch(cfg, B=2)
    loss, grads = loss_and_grad(layout, init_params(layout, cfg, 0), x, y, cfg, 1.0 / x.size)
    # One gradient per node, of its input (the groups' gradients land through the seam): the
    # embedding's scalar start 1, each block 1, head_loss 1 (the loss's scale is the head's).
    assert len(vjp_dtypes) == 1 + cfg.n_layers + 1
    assert {n for n, _ in vjp_dtypes} == {"embedding", "block", "head_loss"}
    # (the embedding's one gradient is the zero of its float64 scalar start; its group's goes through the seam)
    wrong = sorted({(n, str(d)) for n, d in vjp_dtypes if d != np.float32 and n != "embedding"})
    assert not wrong, f"VJPs producing non-float32 gradients: {wrong}"
    assert grads.dtype == np.float32


def test_the_dtype_recorder_catches_a_float64_vjp(vjp_dtypes):
    """The check above can fail: autograd's own `mean` VJP divides by an int and gives float64."""
    autograd.grad(lambda a: anp.sum(anp.mean(a, axis=0)))(np.ones((3, 4), np.float32))
    assert ("mean", np.float64) in vjp_dtypes


# ---- each kernel on its own ---------------------------------------------------------------------

IDS = np.array([[1, 4, 1, 0], [6, 1, 4, 4]])  # (B, T) = (2, 4), repeated ids
SHAPES = group_shapes(ModelConfig(vocab_size=5, seq_len=4, d_model=4, n_heads=2, n_layers=1))
SHAPES = {**SHAPES, "embed": ((7, 4), (6, 4))}                    # 7 token ids, 6 positions
GROUP = {g: sum(math.prod(s) for s in shapes) for g, shapes in SHAPES.items()}
TGT = np.array([0, 3, 3, 1, 4, 2])
KERNELS = {  # name: (function of the differentiable arrays only, their shapes)
    "embed": (lambda wte, wpe: embed(wte, wpe, IDS), [(7, 3), (6, 3)]),
    "layer_norm": (layer_norm, [(4, 5), (5,), (5,)]),
    "layer_norm_3d": (layer_norm, [(2, 3, 5), (5,), (5,)]),
    "linear": (linear, [(4, 3), (3, 5), (5,)]),
    "gelu": (gelu, [(3, 4)]),
    "linear_gelu": (linear_gelu, [(4, 3), (3, 5), (5,)]),
    "attention": (lambda qkv: causal_attention(qkv, 4, 3), [(2 * 4, 3 * 6)]),  # B 2, T 4, H 3, D 2
    "cross_entropy": (lambda z: cross_entropy_sum(z, TGT), [(6, 5)]),
    # the fused parts of capstone.model.blocks, each over its flat parameter group (C 4, H 2, V 5)
    "embedding": (lambda w: embedding(w, IDS, SHAPES["embed"]), [(7 * 4 + 6 * 4,)]),
    "block": (lambda x, w: block(x, w, 4, 2, SHAPES["h0"], ALONE), [(2 * 4, 4), (GROUP["h0"],)]),
    "head_loss": (lambda x, w: head_loss(x, w, TGT, SHAPES["head"]), [(6, 4), (GROUP["head"],)]),
}


def kernel_case(name, dtype, seed=0):
    fn, shapes = KERNELS[name]
    rng = np.random.default_rng(seed)
    args = [rng.standard_normal(s).astype(dtype) * (2.0 if name.endswith("gelu") else 1.0) for s in shapes]
    cotangent = rng.standard_normal(np.shape(fn(*args))).astype(dtype)
    return fn, args, cotangent


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_vjp_matches_finite_differences_float64(name):
    fn, args, r = kernel_case(name, np.float64)
    objective = lambda *a: anp.sum(fn(*a) * r)  # noqa: E731
    h = 1e-6
    for i, a in enumerate(args):
        analytic = autograd.grad(objective, i)(*args)
        numeric = np.zeros_like(a)
        for j in np.ndindex(a.shape):
            for sign in (1.0, -1.0):
                moved = [b.copy() for b in args]
                moved[i][j] += sign * h
                numeric[j] += sign * objective(*moved) / (2 * h)
        assert analytic.dtype == np.float64
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8, err_msg=f"{name} arg {i}")


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_vjp_is_float32_and_pure(name):
    """Called directly (one node: the kernel), each VJP gives float32 for float32 inputs, the argument's
    shape, and the same answer twice without writing to the incoming gradient."""
    fn, args, g = kernel_case(name, np.float32)
    for i, a in enumerate(args):
        vjp, ans = autograd.make_vjp(fn, i)(*args)
        assert np.result_type(ans) == np.float32
        g0 = g.copy()
        first, second = vjp(g), vjp(g)
        assert first.dtype == np.float32 and first.shape == a.shape, (name, i, first.dtype)
        np.testing.assert_array_equal(first, second)
        np.testing.assert_array_equal(g, g0)


@pytest.mark.parametrize("block", [1, 2])
def test_blocked_causal_attention_vjp_matches_finite_differences_float64(monkeypatch, block):
    """The attention case (T 4) cut into query blocks of 1 and 2 rows, each against its keys only."""
    monkeypatch.setattr(kernels, "ATTN_BLOCK", block)
    assert len(kernels._query_blocks(4)) == 4 // block
    test_kernel_vjp_matches_finite_differences_float64("attention")
    test_kernel_vjp_is_float32_and_pure("attention")


def test_blocked_attention_equals_unblocked_float32(monkeypatch):
    rng = np.random.default_rng(4)
    T, H = 130, 2                                          # 64 + 64 + 2: a ragged last block
    qkv = rng.standard_normal((2 * T, 3 * 8), dtype=np.float32)
    g = rng.standard_normal((2 * T, 8), dtype=np.float32)
    results = []
    for rows in (64, 10**6):
        monkeypatch.setattr(kernels, "ATTN_BLOCK", rows)
        vjp, y = autograd.make_vjp(lambda a: causal_attention(a, T, H))(qkv)
        results.append((y, vjp(g), len(kernels._query_blocks(T))))
    (y1, g1, n1), (y2, g2, n2) = results
    assert (n1, n2) == (3, 1) and y1.dtype == g1.dtype == np.float32
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(10, 7), (3, 4, 5), (9,), ()])
def test_gelu_in_row_blocks_equals_one_pass_bit_for_bit(monkeypatch, shape):
    """ROW_BLOCK 14: rows of 7 in blocks of 2 rows and a ragged last block; 1-d and 0-d in one block."""
    rng = np.random.default_rng(5)
    u = np.asarray(rng.standard_normal(shape, dtype=np.float32))
    g = np.asarray(rng.standard_normal(shape, dtype=np.float32))
    results = []
    for block_elems in (14, 10**9):
        monkeypatch.setattr(kernels, "ROW_BLOCK", block_elems)
        assert len(kernels._row_blocks(u)) == (-(-shape[0] // max(1, 14 // math.prod(shape[1:])))
                                                if len(shape) >= 2 and block_elems == 14 else 1)
        y, tp = kernels._gelu_fwd(u)
        results.append((y, tp, kernels._gelu_grad(g, u, tp), kernels._gelu_grad(g.copy(), u, tp, out=g.copy())))
    for a, b in zip(*results):
        assert a.dtype == np.float32 and a.shape == shape and np.array_equal(a, b)
    t = np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u.astype(np.float64) ** 3))
    np.testing.assert_allclose(results[0][0], 0.5 * u * (1 + t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(10, 7), (3, 4, 5), (9,)])
def test_layer_norm_in_row_blocks_equals_one_pass_bit_for_bit(monkeypatch, shape):
    rng = np.random.default_rng(6)
    x, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    w, b = (rng.standard_normal(shape[-1], dtype=np.float32) for _ in range(2))
    results = []
    for block_elems in (14, 10**9):
        monkeypatch.setattr(kernels, "ROW_BLOCK", block_elems)
        y, saved = kernels._ln_fwd(x, w, b)
        d = kernels._ln_bwd(g, saved, (0, 1, 2), x, w, b)
        results.append((y, *saved, d[0], d[1], d[2]))
    for a, c in zip(*results):
        assert a.dtype == np.float32 and np.array_equal(a, c)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(results[0][0], (x - mu) / np.sqrt(var + 1e-5) * w + b, rtol=1e-4, atol=1e-5)


def test_vjp_recomputes_the_forward_when_the_stash_misses():
    fn, args, g = kernel_case("linear_gelu", np.float64)
    ans = linear_gelu(*args)
    maker = primitive_vjps[linear_gelu]
    from_stash = maker((0, 1, 2), ans, tuple(args), {})   # takes the primitive's stash
    recomputed = maker((0, 1, 2), ans, tuple(args), {})
    for a, b in zip(from_stash(g), recomputed(g)):
        np.testing.assert_array_equal(a, b)


# ---- data, layout and config --------------------------------------------------------------------

def test_initial_loss_is_near_uniform_and_learnable_corpus():
    cfg = ModelConfig()
    layout = Layout.for_model(cfg, 1)
    stream = DataStream(make_corpus(0, 1 << 14, cfg.vocab_size), cfg.seq_len, 8, seed=1)
    x, y = stream.samples(0, 8)
    loss = float(loss_sum(layout.groups(init_params(layout, cfg, 0)), x, y, cfg, 1.0 / x.size))
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
    groups = layout.groups(flat)                 # the model's inputs: contiguous, in order, views too
    assert list(groups) == ["embed"] + [f"h{i}" for i in range(cfg.n_layers)] + ["head"]
    ranges = list(layout.group_ranges().values())
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.n_params and all(
        a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert groups["head"][-1] == 2.0 and np.shares_memory(groups["h1"], flat)


def test_bad_model_config_says_what_to_do():
    with pytest.raises(ConfigError, match="divisible by n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ConfigError, match="positive integer"):
        ModelConfig(n_layers=0)
