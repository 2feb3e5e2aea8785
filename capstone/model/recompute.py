"""--recompute (activation checkpointing per block): a transformer block whose forward keeps
nothing but its input (autograd holds that), and whose backward runs the forward again for the
activations it needs, which then exist only while that block's gradient is computed. The
gradients are bit-identical to the plain block's: the same kernels on the same inputs."""

from __future__ import annotations

from capstone.model import blocks
from capstone.model import kernels as K


def _block_fwd(x, w, T, H, shapes, tp):
    return blocks._block_fwd(x, w, T, H, shapes, tp)[0], None      # (B*T, C), nothing saved


def _block_bwd(g, saved, argnums, x, w, T, H, shapes, tp):
    saved = blocks._block_fwd(x, w, T, H, shapes, tp)[1]              # the activations again
    return blocks._block_bwd(g, saved, argnums, x, w, T, H, shapes, tp)


block = K.define("recomputed_block", _block_fwd, _block_bwd)
