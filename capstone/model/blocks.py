"""The model's three fused parts as pairs of forward and backward functions over one flat group.

How it works: docs/design.md, "Inside the step", model/blocks.py.
"""

import functools
import math

import numpy as np

from capstone.model import kernels as K


class Alone:
    """A block not split: the tensor-parallel group of one rank (its sums are the identity), and the sequence
    whole on this rank (positions 0..T-1, the causal kernel; dropout's `drop` masks it: capstone.model.dropout)."""

    size, k = 1, 1   # the ranks splitting the block, and the sequence
    positions = staticmethod(lambda T: None)

    @staticmethod
    def attention(qkv, T, H, drop=None):
        if drop is None:
            y, saved = K._attention_fwd(qkv, T, H)
        else:
            from capstone.model import dropout
            pos = np.arange(T)
            y, saved = dropout.attention_forward(qkv, T, H, drop(pos, pos))
        return y, (saved, drop is not None)

    @staticmethod
    def attention_back(g, saved, argnums, qkv, T, H):
        saved, dropped = saved
        if not dropped:
            return K._attention_bwd(g, saved, argnums, qkv, T, H)
        from capstone.model import dropout
        return {0: dropout.attention_backward(g, saved, qkv, T, H)}

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


def embedding_forward(w, idx, shapes, cp=WHOLE):
    """w = [wte (V, C), wpe (>=T, C)], idx (B, T) at cp's positions -> (B*T, C), nothing saved."""
    return K._embed_fwd(*unpack(w, shapes), idx, cp.positions(idx.shape[1]))


def embedding_backward(g, w, idx, shapes, gw, cp=WHOLE) -> None:
    """The embedding's gradient written into gw (it has no input to differentiate)."""
    d = K._embed_bwd(g, None, (0, 1), *unpack(w, shapes), idx, cp.positions(idx.shape[1]))
    np.concatenate([d[0].reshape(-1), d[1].reshape(-1)], out=gw)


def block_forward(x, w, T, H, shapes, tp, cp=WHOLE, masks=None, layer: int = 0):
    """x + attn(ln_1(x)) = x1; x1 + mlp(ln_2(x1)): (B*T, C) -> (B*T, C), H heads on this rank. `masks` (dropout's
    Masks; None: no dropout): GPT-2's dropout of block `layer` at the attention probabilities and both residuals."""
    ln1w, ln1b, aw, ab, pw, pb, ln2w, ln2b, fw, fb, mw, mb = unpack(w, shapes)
    drop = m1 = m2 = None
    if masks is not None:
        drop = masks.drop(layer, T, H, getattr(tp, "rank", 0) * H)
        m1, m2 = (masks.channels(layer, site, T, x.shape[1]) for site in ("attn_out", "mlp_out"))
    a, s_ln1 = K._ln_fwd(x, ln1w, ln1b)
    qkv, _ = K._linear_fwd(a, aw, ab)                                           # (B*T, 3C/tp)
    y, s_att = cp.attention(qkv, T, H, drop)                                    # (B*T, C/tp)
    x1 = x + _dropped(_row_parallel(y, pw, pb, tp), m1)
    m, s_ln2 = K._ln_fwd(x1, ln2w, ln2b)
    h, s_fc = K._linear_gelu_fwd(m, fw, fb)                                     # (B*T, 4C/tp)
    return x1 + _dropped(_row_parallel(h, mw, mb, tp), m2), [a, s_ln1, qkv, s_att, y, m, s_ln2, h, s_fc, m1, m2]


def _dropped(a, mask):
    """a with dropout's mask applied (None: no dropout)."""
    return a if mask is None else a * mask


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
    a, s_ln1, qkv, s_att, y, m, s_ln2, h, s_fc, m1, m2 = saved
    if free:
        saved.clear()
    ln1w, _, aw, _, pw, _, ln2w, _, fw, _, mw, _ = unpack(w, shapes)
    d_ln1w, d_ln1b, d_aw, d_ab, d_pw, d_pb, d_ln2w, d_ln2b, d_fw, d_fb, d_mw, d_mb = unpack(gw, shapes)
    g2 = _dropped(g, m2)                                                        # the MLP branch's gradient
    K._mm(h.T, g2, out=d_mw)                                                    # _linear_back, with h freed
    if d_mb is not None:
        K._add(g2, axis=0, out=d_mb)                                            # before gh exists: 3.6 MiB
    del h, m2                                                                   # less peak RSS at medium
    gh = K._mm(g2, mw.T)                                                        # (B*T, 4C/tp)
    del g2
    gm = _linear_back(K._gelu_grad(gh, *s_fc, out=gh), m, fw, d_fw, d_fb)       # through the MLP
    del gh, s_fc, m
    tp.Allreduce(gm, "tensor-parallel allreduce of a block's input gradient", "tp_allreduce")   # "f"
    gx1 = g + _ln_back(gm, s_ln2, ln2w, d_ln2w, d_ln2b)
    del gm, s_ln2
    gqkv = cp.attention_back(_linear_back(_dropped(gx1, m1), y, pw, d_pw, d_pb), s_att, (0,), qkv, T, H)[0]
    del s_att, y, qkv, m1
    ga = _linear_back(gqkv, a, aw, d_aw, d_ab)
    tp.Allreduce(ga, "tensor-parallel allreduce of a block's input gradient", "tp_allreduce")   # "f"
    return gx1 + _ln_back(ga, s_ln1, ln1w, d_ln1w, d_ln1b)


def head_logits(x, w, shapes, wte=None):
    """Logits (B*T, V) of the final hidden states x (B*T, C): w = [ln_f.w, ln_f.b, lm_head.w(, lm_head.b)]; tied
    (--tie-embeddings, capstone.model.tied): w = [ln_f.w, ln_f.b(, lm_head.b)], the head wte.T, wte (V, C)."""
    if wte is None:
        lnw, lnb, hw, *hb = unpack(w, shapes)                                  # hb: [] with --no-head-bias
    else:
        (lnw, lnb, *hb), hw = unpack(w, shapes), wte.T
    z_in, s_ln = K._ln_fwd(x, lnw, lnb)
    z = K._mm(z_in, hw)
    if hb:
        z += hb[0]
    return z, (z_in, s_ln)


def head_loss_forward(x, w, targets, shapes, wte=None):
    """Sum over the rows of the cross-entropy of the logits against targets (B*T,) -> scalar."""
    z, (z_in, s_ln) = head_logits(x, w, shapes, wte)
    loss, probs = K._xent_fwd(z, targets)
    return loss, [z_in, s_ln, probs]


def head_loss_backward(g, saved, w, targets, shapes, gw, free: bool, wte=None, gwte=None):
    """The head's gradient into gw (a tied head's share of wte's into gwte); returns the hidden states' (`free`)."""
    z_in, s_ln, probs = saved
    if free:
        saved.clear()
    gz = K._xent_grad_inplace(probs if free else probs.copy(), targets, g)      # over the softmax if owned
    del probs
    if wte is None:
        lnw, _, hw, *_ = unpack(w, shapes)
        d_lnw, d_lnb, d_hw, *d_hb = unpack(gw, shapes)
        return _ln_back(_linear_back(gz, z_in, hw, d_hw, d_hb[0] if d_hb else None), s_ln, lnw, d_lnw, d_lnb)
    lnw, (d_lnw, d_lnb, *d_hb) = unpack(w, shapes)[0], unpack(gw, shapes)
    K._mm(gz.T, z_in, out=gwte)                                                 # z = z_in @ wte.T: d wte = gz.T @ z_in
    if d_hb:
        K._add(gz, axis=0, out=d_hb[0])
    return _ln_back(K._mm(gz, wte), s_ln, lnw, d_lnw, d_lnb)
