"""MiniGPT in NumPy + autograd, float32 end to end (pre-LN GPT-2 blocks, untied LM head).

Activations are 2-D (B*T, C) so every linear layer is one matmul. The layers are the autograd
primitives of `kernels`, each with a hand-written VJP. `Model` owns the flat parameter and
gradient buffers (their named views are what the layers see) and runs forward+backward with the
gradients landing in the flat gradient buffer; `loss_sum` is the differentiable loss.
"""

from __future__ import annotations

import numpy as np

from .backward import value_and_grad_into
from .config import ModelConfig
from .kernels import causal_attention, cross_entropy_sum, embed, layer_norm, linear, linear_gelu
from .params import Layout


def attention(x, p, h, T, H):
    """Causal multi-head self-attention with a fused qkv projection. x (B*T, C) -> (B*T, C)."""
    qkv = linear(x, p[h + "attn.c_attn.w"], p[h + "attn.c_attn.b"])            # (B*T, 3C)
    y = causal_attention(qkv, T, H)                                             # (B*T, C)
    return linear(y, p[h + "attn.c_proj.w"], p[h + "attn.c_proj.b"])


def mlp(x, p, h):
    """Position-wise MLP, 4x wide with GELU. x (B*T, C) -> (B*T, C)."""
    u = linear_gelu(x, p[h + "mlp.c_fc.w"], p[h + "mlp.c_fc.b"])               # (B*T, 4C)
    return linear(u, p[h + "mlp.c_proj.w"], p[h + "mlp.c_proj.b"])


def _hidden(p, idx, cfg: ModelConfig):
    """Final normalised hidden states (B*T, C) for token ids idx (B, T)."""
    T = idx.shape[1]
    x = embed(p["wte"], p["wpe"], idx)                                          # (B*T, C)
    for i in range(cfg.n_layers):
        h = f"h{i}."
        x = x + attention(layer_norm(x, p[h + "ln_1.w"], p[h + "ln_1.b"]), p, h, T, cfg.n_heads)
        x = x + mlp(layer_norm(x, p[h + "ln_2.w"], p[h + "ln_2.b"]), p, h)
    return layer_norm(x, p["ln_f.w"], p["ln_f.b"])


def logits(p, idx, cfg: ModelConfig):
    """Next-token logits (B*T, V) for token ids idx (B, T)."""
    return linear(_hidden(p, idx, cfg), p["lm_head.w"], p["lm_head.b"])


def loss_sum(p, idx, targets, cfg: ModelConfig, scale: float = 1.0):
    """scale * (sum over the B*T positions of the softmax cross-entropy). idx, targets (B, T)."""
    return cross_entropy_sum(logits(p, idx, cfg), targets.reshape(-1)) * scale


def loss_and_grad(p: dict, idx: np.ndarray, targets: np.ndarray, cfg: ModelConfig, scale: float):
    """(loss value, {name: gradient}) of `loss_sum` w.r.t. the arrays of `p` (fresh gradient arrays)."""
    grads = {name: np.zeros_like(a) for name, a in p.items()}
    return value_and_grad_into(loss_sum, p, grads, idx, targets, cfg, scale), grads


class Model:
    """One MiniGPT's parameters and gradients: flat float32 buffers of `layout`, with named views."""

    def __init__(self, cfg: ModelConfig, layout: Layout, params: np.ndarray):
        self.cfg, self.layout = cfg, layout
        self.params, self.grads = params, layout.zeros()
        self.p, self.g = layout.views(self.params), layout.views(self.grads)

    def forward_backward(self, batches, scale: float) -> float:
        """Gradient of scale * (summed loss over every (x, y) in `batches`) into `grads`; returns that loss."""
        self.grads.fill(0.0)
        return sum(value_and_grad_into(loss_sum, self.p, self.g, x, y, self.cfg, scale) for x, y in batches)

    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float:
        """scale * summed loss of one batch, forward only (no graph is built)."""
        return float(loss_sum(self.p, x, y, self.cfg, scale))

    def whole(self) -> np.ndarray:
        """Every parameter of the model (collective in a --tp model: the slices assembled)."""
        return self.params
