"""The one forward and backward driver: the model's layers as autograd nodes over the seam.

How it works: docs/design.md, "Inside the step", model/backward.py.
"""

from dataclasses import dataclass

import numpy as np
from autograd import make_vjp
from autograd.extend import vspace

from capstone.model import blocks
from capstone.model import kernels as K
from capstone.model.seam import Weights


@dataclass(frozen=True)
class Pass:
    """How one forward (and backward) pass runs the layers (see the module)."""

    seam: Weights
    tp: object = blocks.ALONE     # the tensor-parallel group (capstone.model.blocks)
    fresh: bool = False           # the gradients are written over the buffer, not added to it
    recompute: bool = False       # a block saves only its input and recomputes in its backward
    train: bool = True            # False: forward only, nothing saved
    cp: object = blocks.WHOLE     # the sequence's part and attention (capstone.model.ring: split)
    masks: object = None          # this micro-batch's dropout masks (None: no dropout)
    tie: object = None            # this pass's tied wte (None: the head has a matrix of its own)
    later: object = None          # a split backward's weight gradients, kept for its W pass (parallel.pipeline.Later)
    prec: object = None           # --precision bf16: activations kept narrowed (capstone.model.precision.Bf16)


def _embed_mask(ps: Pass, a, T: int):
    """The embedding's dropout mask applied to a (B*T, C) (no dropout: a itself)."""
    return a if ps.masks is None else a * ps.cp.order(ps.masks.channels(-1, "embed", T, a.shape[1]))


def _embedding_fwd(start, ps: Pass, idx, shapes):
    out = blocks.embedding_forward(ps.seam.weights("embed", False), idx, shapes, ps.cp)[0]
    ps.seam.release("embed")
    return _embed_mask(ps, out, idx.shape[1]), None


def _grads(ps: Pass, name: str, shapes) -> tuple:
    """(group `name`'s gradient from the seam, a `put` writing into it now: capstone.model.blocks), or a split
    backward's (None, its `put` keeping the writes for the W pass: capstone.parallel.pipeline.Later)."""
    if ps.later is not None:
        return None, ps.later.group(name, shapes)
    gw = ps.seam.grad_out(name, ps.fresh)
    d = blocks.unpack(gw, shapes)
    return gw, lambda op, *operands: op(d, *operands)


def _landed(ps: Pass, name: str, gw) -> None:
    """Group `name`'s gradient `gw` lands through the seam (None: a split backward keeps it for its W pass), then
    the group's weights are released (`_release`)."""
    if gw is not None:
        ps.seam.landed(name, gw, ps.fresh)
    _release(ps, name)


def _embedding_bwd(g, saved, argnums, start, ps: Pass, idx, shapes):
    gw, put = _grads(ps, "embed", shapes)
    blocks.embedding_backward(_embed_mask(ps, g, idx.shape[1]), ps.seam.weights("embed", True), idx, shapes, put,
                              ps.cp, ps.tie)
    _landed(ps, "embed", gw)
    return {0: np.zeros_like(start)}


def _block_fwd(x, ps: Pass, name: str, T: int, H: int, shapes):
    out, saved = blocks.block_forward(x, ps.seam.weights(name, False), T, H, shapes, ps.tp, ps.cp, ps.masks,
                                      int(name[1:]))
    ps.seam.release(name)
    return out, _kept(ps, saved) if ps.train and not ps.recompute else None


def _block_bwd(g, saved, argnums, x, ps: Pass, name: str, T: int, H: int, shapes):
    w = ps.seam.weights(name, True)
    if saved is None:     # recomputation: the activations again, from the block's input (the same masks), as kept
        saved = _kept(ps, blocks.block_forward(x, w, T, H, shapes, ps.tp, ps.cp, ps.masks, int(name[1:]))[1])
    saved = _kept(ps, saved, back=True)
    gw, put = _grads(ps, name, shapes)
    gx = blocks.block_backward(g, saved, x, w, T, H, shapes, ps.tp, put, free=True, cp=ps.cp)
    _landed(ps, name, gw)
    return {0: gx}


def _head_fwd(x, ps: Pass, targets, shapes, scale):
    loss, saved = blocks.head_loss_forward(x, ps.seam.weights("head", False), targets, shapes, scale,
                                           None if ps.tie is None else ps.tie.wte(ps.seam), ps.cp)
    _release(ps, "head")
    return loss, _kept(ps, saved) if ps.train else None


def _head_bwd(g, saved, argnums, x, ps: Pass, targets, shapes, scale):
    (gw, put), w, saved = _grads(ps, "head", shapes), ps.seam.weights("head", True), _kept(ps, saved, True)
    wte = None if ps.tie is None else ps.tie.wte(ps.seam)
    gwte = None if wte is None else ps.cp.share_buffer(wte)
    gx = blocks.head_loss_backward(g, saved, w, targets, shapes, put, True, scale, wte, gwte, ps.cp)
    if ps.tie is not None:
        ps.tie.made(gwte)       # the head's share of wte's gradient, for the embedding's backward
    _landed(ps, "head", gw)
    return {0: gx}


def _kept(ps: Pass, saved, back: bool = False):
    """What a layer keeps for its backward pass (bf16: narrowed); `back`: what it kept, as float32 again."""
    return saved if ps.prec is None else (ps.prec.unkept if back else ps.prec.keep)(saved)


def _release(ps: Pass, name: str) -> None:
    ps.seam.release(name)
    if name == "head" and ps.tie is not None:      # the head read wte from the embedding's group
        ps.seam.release("embed")


embedding = K.define("embedding", _embedding_fwd, _embedding_bwd)
block = K.define("block", _block_fwd, _block_bwd)
head_loss = K.define("head_loss", _head_fwd, _head_bwd)


def differentiate(fun, start):
    """(fun(start), backward): `backward(g)` runs the pass's VJPs once, in reverse, landing every layer's gradient
    through the seam; returns d(g . fun)/d start (g None: a scalar fun's own; start: a stage's input or an anchor)."""
    vjp, out = make_vjp(fun)(start)
    return out, lambda g=None: vjp(vspace(out).ones() if g is None else g)
