"""MiniGPT in NumPy + autograd, float32 end to end (pre-LN GPT-2 blocks, untied LM head).

Activations are 2-D (B*T, C) so every linear layer is one matmul. The model is three kinds of
autograd primitive (`capstone.model.blocks`): the embedding, a transformer block, the head with
the loss, each over one flat parameter group and with a hand-written VJP. `Model` owns the flat
parameter and gradient buffers (the groups are views into them) and runs forward+backward with the
gradients landing in the flat gradient buffer; `loss_sum` is the differentiable loss. `tp` is the
tensor-parallel group the blocks are split over (`blocks.ALONE`: not split).
"""

from __future__ import annotations

import numpy as np

from capstone.config import ModelConfig
from capstone.model.backward import value_and_grad_into
from capstone.model.blocks import ALONE, block, embedding, head_logits, head_loss
from capstone.model.params import Layout, group_shapes


def _hidden(t, idx, cfg: ModelConfig, tp=ALONE, layer=block, x=None, embed=embedding):
    """Hidden states (B*T, C) after the blocks (`layer`) in t (Layout.groups: the whole model's, or a
    pipeline stage's) for token ids idx (B, T), from the embedding or `x` (the previous stage's)."""
    shapes, H = group_shapes(cfg, tp.size), cfg.n_heads // tp.size
    if x is None:
        x = embed(t["embed"], idx, shapes["embed"])                             # (B*T, C)
    for name in (g for g in t if g not in ("embed", "head")):                   # the blocks, in order
        x = layer(x, t[name], idx.shape[1], H, shapes[name], tp)               # (B*T, C)
    return x


def logits(t, idx, cfg: ModelConfig, tp=ALONE):
    """Next-token logits (B*T, V) for token ids idx (B, T), forward only."""
    return head_logits(_hidden(t, idx, cfg, tp), t["head"], group_shapes(cfg, tp.size)["head"])[0]


def loss_sum(t, idx, targets, cfg: ModelConfig, scale=1.0, tp=ALONE, layer=block, embed=embedding, head=head_loss):
    """scale * (sum over the B*T positions of the softmax cross-entropy). idx, targets (B, T). The
    layers are arguments: recomputed blocks, or ZeRO-3's layers that gather their own groups."""
    x = _hidden(t, idx, cfg, tp, layer, embed=embed)
    return head(x, t["head"], targets.reshape(-1), group_shapes(cfg, tp.size)["head"]) * scale


def loss_and_grad(layout: Layout, flat: np.ndarray, idx: np.ndarray, targets: np.ndarray, cfg: ModelConfig,
                  scale: float):
    """(loss value, gradient as a fresh flat buffer of `layout`) of `loss_sum` at parameters `flat`."""
    grads = np.zeros_like(flat)
    return value_and_grad_into(loss_sum, layout.groups(flat), layout.groups(grads), idx, targets, cfg, scale), grads


class Model:
    """One MiniGPT's parameters and gradients (this rank's part under tensor parallelism): flat
    float32 buffers of `layout`, with named views (`p`, `g`) and the group views the model
    computes with (`groups`, `grad_groups`)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, params: np.ndarray, tp=ALONE, recompute: bool = False,
                 grads: bool = True):
        """`grads` False (ZeRO-2): no gradient buffer; each group's gradient goes to the grad hook."""
        self.cfg, self.layout, self.tp, self.layer = cfg, layout, tp, block
        if recompute:
            from capstone.model import recompute as checkpointed
            self.layer = checkpointed.block
        self.params, self.grads = params, layout.zeros() if grads else None
        self.p, self.groups = layout.views(self.params), layout.groups(self.params)
        self.g, self.grad_groups = (layout.views(self.grads), layout.groups(self.grads)) if grads else (None, None)

    def micro_batch(self, x: np.ndarray, y: np.ndarray, scale: float, fresh: bool) -> float:
        """Gradient of scale * (summed loss of one micro-batch) added into `grads` (`fresh`: written
        over whatever they held); returns that loss."""
        return value_and_grad_into(loss_sum, self.groups, self.grad_groups, x, y, self.cfg, scale, self.tp,
                                   self.layer, fresh=fresh)

    def forward_backward(self, batches, scale: float) -> float:
        """Gradient of scale * (summed loss over every (x, y) in `batches`) into `grads`; returns that loss."""
        return sum(self.micro_batch(x, y, scale, fresh=j == 0) for j, (x, y) in enumerate(batches))

    def whole(self) -> np.ndarray:
        """The flat parameter buffer (this rank's slice of the model under tensor parallelism)."""
        return self.params

    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float:
        """scale * summed loss of one batch, forward only (no graph is built)."""
        return float(loss_sum(self.groups, x, y, self.cfg, scale, self.tp))
