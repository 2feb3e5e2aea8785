"""The model with its options on (imported only then): a tied head (capstone.model.tied) and dropout
(capstone.model.dropout). `run_layers` is capstone.model.gpt.run_layers with their layers: the
embedding here (its output dropped, its gradient summed with the tied head's share of wte's before
the group lands), the dropout blocks while training, and the tied head.
"""

from __future__ import annotations

import numpy as np

from capstone.config import ModelConfig
from capstone.model import backward, blocks
from capstone.model import kernels as K
from capstone.model.backward import Pass
from capstone.model.params import group_shapes


def _embedding_fwd(start, ps: Pass, idx, shapes, tie, masks):
    out = blocks.embedding_forward(ps.seam.weights("embed", False), idx, shapes, ps.cp)[0]
    ps.seam.release("embed")
    if masks is not None:
        out = out * masks.channels(-1, "embed", idx.shape[1], out.shape[1])
    return out, None


def _embedding_bwd(g, saved, argnums, start, ps: Pass, idx, shapes, tie, masks):
    if masks is not None:
        g = g * masks.channels(-1, "embed", idx.shape[1], g.shape[1])
    w, gw = ps.seam.weights("embed", True), ps.seam.grad_out("embed", ps.fresh)
    blocks.embedding_backward(g, w, idx, shapes, gw, ps.cp)
    share = None if tie is None else tie.share()
    if share is not None:                              # wte's gradient: the sum of its two uses
        gw[:share.size] += share.reshape(-1)
    ps.seam.landed("embed", gw, ps.fresh)
    ps.seam.release("embed")
    return {0: np.zeros_like(start)}


embedding = K.define("options_embedding", _embedding_fwd, _embedding_bwd)


def run_layers(ps: Pass, cfg: ModelConfig, names, start, idx, targets, scale):
    """The part of the model of group `names` with its options (capstone.model.gpt.run_layers)."""
    shapes, H, T = group_shapes(cfg, ps.tp.size), cfg.n_heads // ps.tp.size, idx.shape[1]
    tie, masks = None, None
    if cfg.tie_embeddings:
        from capstone.model import tied
        tie = tied.for_pass(ps.seam, shapes["embed"][0])
    if cfg.dropout and ps.train:
        from capstone.model import dropout
        masks = ps.seam.next_masks(idx.shape[0])
    x = embedding(start, ps, idx, shapes["embed"], tie, masks) if "embed" in names else start
    for name in (g for g in names if g not in ("embed", "head")):
        x = (backward.block(x, ps, name, T, H, shapes[name]) if masks is None
             else dropout.block(x, ps, name, T, H, shapes[name], masks))
    if "head" not in names:
        return x
    if tie is None:
        return backward.head_loss(x, ps, targets.reshape(-1), shapes["head"]) * scale
    return tied.head_loss(x, ps, targets.reshape(-1), shapes["head"], tie) * scale
