"""The one forward and backward driver: the model's layers as autograd nodes over the seam.

The parameters are not inputs of the autograd graph. Each layer is one autograd primitive whose only
differentiable input is its activations (the embedding's: the scalar `start`), and which gets its group's weights
from the seam (capstone.model.seam) by name, in its forward and again in its backward, writes the group's gradient
where the seam says and tells it the gradient has landed. So the graph holds no weights (ZeRO-3 gathers a block
for its forward, drops it, and gathers it again for its backward), each gradient leaves the graph the moment its
layer's VJP has made it (reverse order of use: the head first), and one driver serves every mode: `differentiate`
is the only place a graph is built (`autograd.make_vjp`).

A `Pass` says how the layers run: over which seam and tensor-parallel group, whether the gradients overwrite the
buffer (`fresh`, a step's first micro-batch), whether a block keeps its activations or runs its forward again in
its backward (`recompute`, activation checkpointing: the same kernels on the same inputs, so the same bits), and
whether the graph is built at all (`train`; an evaluation keeps nothing). Each VJP runs once, so it owns its saved
activations and frees them as it goes (capstone.model.blocks), which lowers the backward pass's peak.
"""

from __future__ import annotations

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


def _embedding_fwd(start, ps: Pass, idx, shapes):
    out = blocks.embedding_forward(ps.seam.weights("embed", False), idx, shapes, ps.cp)[0]
    ps.seam.release("embed")
    return out, None


def _embedding_bwd(g, saved, argnums, start, ps: Pass, idx, shapes):
    w, gw = ps.seam.weights("embed", True), ps.seam.grad_out("embed", ps.fresh)
    blocks.embedding_backward(g, w, idx, shapes, gw, ps.cp)
    ps.seam.landed("embed", gw, ps.fresh)
    ps.seam.release("embed")
    return {0: np.zeros_like(start)}


def _block_fwd(x, ps: Pass, name: str, T: int, H: int, shapes):
    out, saved = blocks.block_forward(x, ps.seam.weights(name, False), T, H, shapes, ps.tp, ps.cp)
    ps.seam.release(name)
    return out, saved if ps.train and not ps.recompute else None


def _block_bwd(g, saved, argnums, x, ps: Pass, name: str, T: int, H: int, shapes):
    w = ps.seam.weights(name, True)
    if saved is None:     # recomputation: the activations again, from the block's input
        saved = blocks.block_forward(x, w, T, H, shapes, ps.tp, ps.cp)[1]
    gw = ps.seam.grad_out(name, ps.fresh)
    gx = blocks.block_backward(g, saved, x, w, T, H, shapes, ps.tp, gw, free=True, cp=ps.cp)
    ps.seam.landed(name, gw, ps.fresh)
    ps.seam.release(name)
    return {0: gx}


def _head_fwd(x, ps: Pass, targets, shapes):
    loss, saved = blocks.head_loss_forward(x, ps.seam.weights("head", False), targets, shapes)
    ps.seam.release("head")
    return loss, saved if ps.train else None


def _head_bwd(g, saved, argnums, x, ps: Pass, targets, shapes):
    w, gw = ps.seam.weights("head", True), ps.seam.grad_out("head", ps.fresh)
    gx = blocks.head_loss_backward(g, saved, w, targets, shapes, gw, free=True)
    ps.seam.landed("head", gw, ps.fresh)
    ps.seam.release("head")
    return {0: gx}


embedding = K.define("embedding", _embedding_fwd, _embedding_bwd)
block = K.define("block", _block_fwd, _block_bwd)
head_loss = K.define("head_loss", _head_fwd, _head_bwd)


def differentiate(fun, start):
    """(fun(start), backward): `backward(g)` runs the pass's VJPs once, in reverse, landing every
    layer's gradient through the seam, and returns d(g . fun)/d start (a pipeline stage sends it
    back; a whole model's start is a scalar anchor). g None: the gradient of a scalar fun itself."""
    vjp, out = make_vjp(fun)(start)

    def backward(g=None):
        return vjp(vspace(out).ones() if g is None else g)
    return out, backward
