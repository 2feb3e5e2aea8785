"""The model's three fused parts as pairs of forward and backward functions over one flat group.

`embedding` (wte, wpe), `block` (one pre-LN transformer block: LayerNorm, qkv, attention, output projection,
residual, LayerNorm, MLP, residual) and `head_loss` (final LayerNorm, LM head, cross-entropy) compose the kernels
of `capstone.model.kernels`. A group is a contiguous slice of the flat parameter buffer (`Layout.groups`);
`*_forward(...)` returns (output, saved) and `*_backward(g, saved, ..., gw)` writes the group's gradient into the
flat array `gw` (on a step's first micro-batch, the group's slice of the flat gradient buffer itself) and returns
the input's gradient. The backward pass of a training step (capstone.model.backward) makes each pair one autograd
node, so the graph of a step has L + 2 nodes: at the reference size autograd's bookkeeping was a third of the
step. With `free` a backward owns `saved` and frees each activation once used (a lower peak). Shapes: N = B*T rows
of width C; `shapes` lists the group's parameter shapes in buffer order.

Tensor parallelism (Megatron-style) is a property of the block, not another model: `tp` is the
communicator of the ranks that split it (`ALONE` when nobody does). Each holds H/tp whole heads of
c_attn and 1/tp of the columns of mlp.c_fc (column parallel), and the matching rows of both c_proj
weights (row parallel); the rest, row-parallel biases included, is whole on every rank. The forward
sums the two row-parallel outputs over `tp` before their bias ("g"); the backward sums the input
gradients of the two column-parallel layers over `tp` ("f"). At tp = 1 those sums do nothing.
`cp` gives the rows' positions and the attention over the whole sequence (`WHOLE`: the rows are
it; capstone.model.ring: a context-parallel ring's part of it).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from capstone.model import kernels as K


class Alone:
    """A block not split: the tensor-parallel group of one rank (its sums are the identity), and the
    sequence whole on this rank (its positions 0..T-1, the causal kernel)."""

    size = 1
    positions = staticmethod(lambda T: None)
    attention, attention_back = staticmethod(K._attention_fwd), staticmethod(K._attention_bwd)

    def Allreduce(self, buf, what: str, kind: str = "") -> np.ndarray:
        return buf


ALONE = WHOLE = Alone()


@functools.lru_cache(maxsize=64)
def _spans(shapes: tuple) -> tuple:
    """((start, end, shape), ...) of each shape's slice of a group's flat array (None: no slice)."""
    ends = np.cumsum([0 if shape is None else math.prod(shape) for shape in shapes]).tolist()
    return tuple(zip([0] + ends[:-1], ends, shapes))


def unpack(w: np.ndarray, shapes: tuple) -> list[np.ndarray]:
    """Views of the group's flat array w, one per shape, in order (None for an absent bias: --no-bias)."""
    return [None if shape is None else w[a:b].reshape(shape) for a, b, shape in _spans(shapes)]


def _linear_back(g, x, w, gw, gb):
    """y = x @ w + b: dw and db written into gw, gb (None: no bias); returns dx = g @ w^T."""
    K._mm(x.T, g, out=gw)
    if gb is not None:
        K._add(g, axis=0, out=gb)
    return K._mm(g, w.T)


def _ln_back(g, saved, w, gw, gb):
    """LayerNorm: dw and db written into gw, gb (None: no bias); returns dx."""
    d = K._ln_bwd(g, saved, (0, 1) if gb is None else (0, 1, 2), g, w, None)  # the input only gives the shape
    gw[...] = d[1]
    if gb is not None:
        gb[...] = d[2]
    return d[0]


# ---- token + position embedding ---------------------------------------------------------------

def embedding_forward(w, idx, shapes, cp=WHOLE):
    """w = [wte (V, C), wpe (>=T, C)], idx (B, T) at cp's positions -> (B*T, C), nothing saved."""
    return K._embed_fwd(*unpack(w, shapes), idx, cp.positions(idx.shape[1]))


def embedding_backward(g, w, idx, shapes, gw, cp=WHOLE) -> None:
    """The embedding's gradient written into gw (it has no input to differentiate)."""
    d = K._embed_bwd(g, None, (0, 1), *unpack(w, shapes), idx, cp.positions(idx.shape[1]))
    np.concatenate([d[0].reshape(-1), d[1].reshape(-1)], out=gw)


# ---- one transformer block ----------------------------------------------------------------------

def block_forward(x, w, T, H, shapes, tp, cp=WHOLE):
    """x + attn(ln_1(x)) = x1; x1 + mlp(ln_2(x1)): (B*T, C) -> (B*T, C), H heads on this rank. w holds,
    in order, ln_1.w/b, attn.c_attn.w/b, attn.c_proj.w/b, ln_2.w/b, mlp.c_fc.w/b, mlp.c_proj.w/b."""
    ln1w, ln1b, aw, ab, pw, pb, ln2w, ln2b, fw, fb, mw, mb = unpack(w, shapes)
    a, s_ln1 = K._ln_fwd(x, ln1w, ln1b)
    qkv, _ = K._linear_fwd(a, aw, ab)                                           # (B*T, 3C/tp)
    y, s_att = cp.attention(qkv, T, H)                                          # (B*T, C/tp)
    x1 = x + _row_parallel(y, pw, pb, tp)
    m, s_ln2 = K._ln_fwd(x1, ln2w, ln2b)
    h, s_fc = K._linear_gelu_fwd(m, fw, fb)                                     # (B*T, 4C/tp)
    return x1 + _row_parallel(h, mw, mb, tp), [a, s_ln1, qkv, s_att, y, m, s_ln2, h, s_fc]


def _row_parallel(x, w, b, tp):
    """x @ w summed over the tensor-parallel ranks ("g"), then + b (if any): (B*T, Cin/tp) -> (B*T, C)."""
    y = K._mm(x, w)
    tp.Allreduce(y, "tensor-parallel allreduce of a block's output", "tp_allreduce")
    if b is not None:
        y += b
    return y


def block_backward(g, saved, x, w, T, H, shapes, tp, gw, free: bool, cp=WHOLE):
    """The block's gradient written into gw; returns its input's. With `free` each activation is
    freed once used: the block's MLP activations are gone before the attention's temporaries exist."""
    a, s_ln1, qkv, s_att, y, m, s_ln2, h, s_fc = saved
    if free:
        saved.clear()
    ln1w, _, aw, _, pw, _, ln2w, _, fw, _, mw, _ = unpack(w, shapes)
    d_ln1w, d_ln1b, d_aw, d_ab, d_pw, d_pb, d_ln2w, d_ln2b, d_fw, d_fb, d_mw, d_mb = unpack(gw, shapes)
    K._mm(h.T, g, out=d_mw)                                                     # _linear_back, with h freed
    if d_mb is not None:
        K._add(g, axis=0, out=d_mb)                                             # before gh exists: 3.6 MiB
    del h                                                                       # less peak RSS at medium
    gh = K._mm(g, mw.T)                                                         # (B*T, 4C/tp)
    gm = _linear_back(K._gelu_grad(gh, *s_fc, out=gh), m, fw, d_fw, d_fb)       # through the MLP
    del gh, s_fc, m
    tp.Allreduce(gm, "tensor-parallel allreduce of a block's input gradient", "tp_allreduce")   # "f"
    gx1 = g + _ln_back(gm, s_ln2, ln2w, d_ln2w, d_ln2b)
    del gm, s_ln2
    gqkv = cp.attention_back(_linear_back(gx1, y, pw, d_pw, d_pb), s_att, (0,), qkv, T, H)[0]
    del s_att, y, qkv
    ga = _linear_back(gqkv, a, aw, d_aw, d_ab)
    tp.Allreduce(ga, "tensor-parallel allreduce of a block's input gradient", "tp_allreduce")   # "f"
    return gx1 + _ln_back(ga, s_ln1, ln1w, d_ln1w, d_ln1b)


# ---- final LayerNorm, LM head, cross-entropy ---------------------------------------------------

def head_logits(x, w, shapes):
    """Logits (B*T, V) of the final hidden states x (B*T, C): w = [ln_f.w, ln_f.b, lm_head.w(, lm_head.b)]."""
    lnw, lnb, hw, *hb = unpack(w, shapes)                                      # hb: [] with --no-head-bias
    z_in, s_ln = K._ln_fwd(x, lnw, lnb)
    z = K._mm(z_in, hw)
    if hb:
        z += hb[0]
    return z, (z_in, s_ln)


def head_loss_forward(x, w, targets, shapes):
    """Sum over the rows of the cross-entropy of the logits against targets (B*T,) -> scalar."""
    z, (z_in, s_ln) = head_logits(x, w, shapes)
    loss, probs = K._xent_fwd(z, targets)
    return loss, [z_in, s_ln, probs]


def head_loss_backward(g, saved, w, targets, shapes, gw, free: bool):
    """The head's gradient written into gw; returns the hidden states' (freeing `saved` if `free`)."""
    z_in, s_ln, probs = saved
    if free:
        saved.clear()
    lnw, _, hw, *_ = unpack(w, shapes)
    d_lnw, d_lnb, d_hw, *d_hb = unpack(gw, shapes)
    gz = K._xent_grad_inplace(probs if free else probs.copy(), targets, g)      # over the softmax if owned
    del probs
    return _ln_back(_linear_back(gz, z_in, hw, d_hw, d_hb[0] if d_hb else None), s_ln, lnw, d_lnw, d_lnb)
