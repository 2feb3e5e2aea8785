"""--tie-embeddings: the LM head is the token embedding wte, as GPT-2's (imported only when on).

The tied model has no lm_head.w (capstone.model.params): its head computes z = ln_f(x) @ wte.T
(+ lm_head.b), reading wte from the embedding group through the seam (capstone.model.seam; at
ZeRO-3 the group is gathered for it, asked for as a backward's so nothing is prefetched after it).
wte's gradient is the sum of its two uses: the head's backward (first in the backward pass) makes
its share, a (V, C) array the pass's `Tie` carries to the embedding's backward (last: the
embedding of capstone.model.options), which adds it to the embedding's own before the group's
gradient lands, so every reducer, ZeRO stage and
accumulation sees one gradient of wte, as for any parameter. Under tensor parallelism the
embedding and head are whole on every rank, as they are untied. Under a pipeline the two uses are
on the first and last stages: the pass's Tie is then capstone.parallel.tiedstages's, which reads
the last stage's copy of wte and hands the head's share to the first stage (`made`, `share`).
"""

from __future__ import annotations

import numpy as np

from capstone.config import ModelConfig
from capstone.model import blocks
from capstone.model import kernels as K
from capstone.model.backward import Pass
from capstone.model.params import group_shapes
from capstone.model.seam import Resident


class Tie:
    """One pass's tied wte: its shape (V, C), and the head's share of its gradient until the embedding's backward."""

    def __init__(self, shape: tuple):
        self.shape, self.grad = shape, None

    def wte(self, seam) -> np.ndarray:
        """wte (V, C): the embedding group's first array (the caller releases "embed")."""
        return seam.weights("embed", True)[:self.shape[0] * self.shape[1]].reshape(self.shape)

    def made(self) -> None:
        """The head's backward has made its share (`grad`): here it waits for the embedding's."""

    def share(self) -> np.ndarray | None:
        """The head's share of wte's gradient for the embedding's backward (None: no head in this pass)."""
        grad, self.grad = self.grad, None
        return grad


def for_pass(seam, shape: tuple) -> Tie:
    """The pass's Tie: the seam's (a pipeline's first and last stages, capstone.parallel.tiedstages), else one."""
    return seam.tie(shape) if hasattr(seam, "tie") else Tie(shape)


def head_logits(x, w, shapes, wte):
    """Logits (B*T, V) of the final hidden states x: w = [ln_f.w, ln_f.b(, lm_head.b)], the head wte.T."""
    lnw, lnb, *hb = blocks.unpack(w, shapes)
    z_in, s_ln = K._ln_fwd(x, lnw, lnb)
    z = K._mm(z_in, wte.T)
    if hb:
        z += hb[0]
    return z, (z_in, s_ln)


def head_backward(g, saved, w, targets, shapes, gw, wte, gwte):
    """The head's gradient into gw and its share of wte's into gwte (V, C); returns the hidden states'."""
    z_in, s_ln, probs = saved
    saved.clear()
    lnw = blocks.unpack(w, shapes)[0]
    d_lnw, d_lnb, *d_hb = blocks.unpack(gw, shapes)
    gz = K._xent_grad_inplace(probs, targets, g)
    del probs
    K._mm(gz.T, z_in, out=gwte)                     # z = z_in @ wte.T: d wte = gz.T @ z_in
    if d_hb:
        K._add(gz, axis=0, out=d_hb[0])
    gx = K._mm(gz, wte)
    return blocks._ln_back(gx, s_ln, lnw, d_lnw, d_lnb)


def _head_fwd(x, ps: Pass, targets, shapes, tie: Tie):
    z, (z_in, s_ln) = head_logits(x, ps.seam.weights("head", False), shapes, tie.wte(ps.seam))
    ps.seam.release("head")
    ps.seam.release("embed")
    loss, probs = K._xent_fwd(z, targets)
    return loss, [z_in, s_ln, probs] if ps.train else None


def _head_bwd(g, saved, argnums, x, ps: Pass, targets, shapes, tie: Tie):
    w, gw, wte = ps.seam.weights("head", True), ps.seam.grad_out("head", ps.fresh), tie.wte(ps.seam)
    tie.grad = np.empty_like(wte)
    gx = head_backward(g, saved, w, targets, shapes, gw, wte, tie.grad)
    tie.made()
    ps.seam.landed("head", gw, ps.fresh)
    ps.seam.release("head")
    ps.seam.release("embed")
    return {0: gx}


head_loss = K.define("tied_head_loss", _head_fwd, _head_bwd)


def logits(x, groups: dict, cfg: ModelConfig, tp: int = 1):
    """Next-token logits (B*T, V) of the tied model's final hidden states x, forward only."""
    shapes = group_shapes(cfg, tp)
    return head_logits(x, groups["head"], shapes["head"], Tie(shapes["embed"][0]).wte(Resident(groups)))[0]

