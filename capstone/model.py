"""MiniGPT in autograd.numpy, float32 end to end (pre-LN GPT-2 blocks, untied LM head).

Activations are 2-D (B*T, C) so every linear layer is one matmul. Float32 is kept through the
backward pass on purpose: no `anp.mean` (its VJP divides by an int64 and NumPy 2 promotes to
float64), no `**` with non-Python exponents, and the softmax shift uses a stop-gradient max
(the shift cancels mathematically, and `anp.max`'s VJP divides by an integer count).
"""

from __future__ import annotations

import math

import autograd
import autograd.numpy as anp
import numpy as np
from autograd.tracer import getval

from .config import ModelConfig

GELU_K = math.sqrt(2.0 / math.pi)


def layer_norm(x, w, b, eps=1e-5):
    """LayerNorm over the last axis: x (N, C), w/b (C,)."""
    inv_c = 1.0 / x.shape[-1]
    mu = anp.sum(x, axis=-1, keepdims=True) * inv_c            # (N, 1)
    xc = x - mu
    var = anp.sum(xc * xc, axis=-1, keepdims=True) * inv_c     # (N, 1)
    return xc / anp.sqrt(var + eps) * w + b


def gelu(x):
    """GELU, tanh approximation (GPT-2)."""
    return 0.5 * x * (1.0 + anp.tanh(GELU_K * (x + 0.044715 * x * x * x)))


def softmax_rows(z):
    """Softmax over the last axis with a stop-gradient shift (shift-invariant, so exact)."""
    e = anp.exp(z - np.max(getval(z), axis=-1, keepdims=True))
    return e / anp.sum(e, axis=-1, keepdims=True)


def causal_mask(T: int) -> np.ndarray:
    """(T, T) additive mask: 0 on and below the diagonal, -inf above."""
    return np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)


def attention(x, p, h, B, T, H, mask):
    """Causal multi-head self-attention with a fused qkv projection. x (B*T, C) -> (B*T, C)."""
    C = x.shape[-1]
    D = C // H
    qkv = anp.dot(x, p[h + "attn.c_attn.w"]) + p[h + "attn.c_attn.b"]   # (B*T, 3C)
    qkv = anp.transpose(anp.reshape(qkv, (B, T, 3, H, D)), (2, 0, 3, 1, 4))  # (3, B, H, T, D)
    q, k, v = qkv[0], qkv[1], qkv[2]                                     # (B, H, T, D)
    att = anp.matmul(q, anp.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(D)) + mask  # (B, H, T, T)
    y = anp.matmul(softmax_rows(att), v)                                 # (B, H, T, D)
    y = anp.reshape(anp.transpose(y, (0, 2, 1, 3)), (B * T, C))
    return anp.dot(y, p[h + "attn.c_proj.w"]) + p[h + "attn.c_proj.b"]


def mlp(x, p, h):
    """Position-wise MLP, 4x wide with GELU. x (B*T, C) -> (B*T, C)."""
    u = gelu(anp.dot(x, p[h + "mlp.c_fc.w"]) + p[h + "mlp.c_fc.b"])      # (B*T, 4C)
    return anp.dot(u, p[h + "mlp.c_proj.w"]) + p[h + "mlp.c_proj.b"]


def logits(p, idx, cfg: ModelConfig):
    """Next-token logits (B*T, V) for token ids idx (B, T)."""
    B, T = idx.shape
    x = anp.reshape(p["wte"][idx] + p["wpe"][:T], (B * T, cfg.d_model))  # (B*T, C)
    mask = causal_mask(T)
    for i in range(cfg.n_layers):
        h = f"h{i}."
        x = x + attention(layer_norm(x, p[h + "ln_1.w"], p[h + "ln_1.b"]), p, h, B, T, cfg.n_heads, mask)
        x = x + mlp(layer_norm(x, p[h + "ln_2.w"], p[h + "ln_2.b"]), p, h)
    x = layer_norm(x, p["ln_f.w"], p["ln_f.b"])
    return anp.dot(x, p["lm_head.w"]) + p["lm_head.b"]                   # (B*T, V)


def loss_sum(p, idx, targets, cfg: ModelConfig, scale: float = 1.0):
    """scale * (sum over the B*T positions of the softmax cross-entropy). idx, targets (B, T)."""
    z = logits(p, idx, cfg)                                               # (B*T, V)
    z = z - np.max(getval(z), axis=1, keepdims=True)
    logp = z - anp.log(anp.sum(anp.exp(z), axis=1, keepdims=True))
    onehot = np.zeros(z.shape, dtype=np.float32)
    onehot[np.arange(z.shape[0]), targets.reshape(-1)] = 1.0
    return -anp.sum(logp * onehot) * scale


_value_and_grad = autograd.value_and_grad(loss_sum)


def loss_and_grad(p: dict, idx: np.ndarray, targets: np.ndarray, cfg: ModelConfig, scale: float):
    """(loss value, {name: gradient}) of `loss_sum`; gradients are float32 like the parameters."""
    value, grads = _value_and_grad(p, idx, targets, cfg, scale)
    return float(value), grads
