"""MiniGPT in NumPy + autograd, float32 end to end (pre-LN GPT-2 blocks, untied LM head).

Activations are 2-D (B*T, C) so every linear layer is one matmul. The layers are the autograd
primitives of `kernels`, each with a hand-written VJP (embedding, LayerNorm, linear, linear+GELU,
causal attention on the fused qkv buffer, softmax cross-entropy), so the graph has a few nodes per
block. `loss_sum` stays differentiable by autograd w.r.t. the params dict; `loss_and_grad` runs the
same graph with one root node per parameter, which skips autograd's per-lookup dict VJPs. Every
gradient has the parameters' dtype (float32 in training; see `kernels` for the NEP 50 pitfalls).
"""

from __future__ import annotations

import numpy as np
from autograd.core import VJPNode, add_outgrads, vspace
from autograd.tracer import new_box, trace_stack
from autograd.util import toposort

from .config import ModelConfig
from .kernels import GELU_K, causal_mask, gelu, layer_norm  # noqa: F401  (public names of this module)
from .kernels import causal_attention, cross_entropy_sum, embed, linear, linear_gelu


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
    """(loss value, {name: gradient}) of `loss_sum`; gradients have the parameters' dtype (float32).

    Same result as `autograd.value_and_grad(loss_sum)(p, ...)`, but each parameter is its own root
    node instead of the dict being one boxed container: autograd's container VJPs rebuild a
    vector space of the whole dict per lookup, which costs more than the model at small sizes.
    """
    with trace_stack.new_trace() as trace:
        roots = {name: VJPNode.new_root() for name in p}
        end = loss_sum({name: new_box(a, trace, roots[name]) for name, a in p.items()}, idx, targets, cfg, scale)
    value, end_node = end._value, end._node
    names = {node: name for name, node in roots.items()}
    grads = {}
    outgrads = {end_node: (vspace(value).ones(), False)}
    for node in toposort(end_node):                    # autograd.core.backward_pass, keeping the roots
        g = outgrads.pop(node)[0]
        if node in names:
            grads[names[node]] = g
        for parent, parent_g in zip(node.parents, node.vjp(g)):
            outgrads[parent] = add_outgrads(outgrads.get(parent), parent_g)
    return float(value), {name: grads[name] if name in grads else np.zeros_like(a) for name, a in p.items()}
