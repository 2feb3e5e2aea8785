"""The model's three fused parts as pairs of forward and backward functions over one flat group
(docs/design.md, "Inside the step", model/blocks.py)."""

import functools
import math

import numpy as np

from capstone.model import kernels as K


def _dense_grads(d, i, x, g, split=None):
    """y = x @ w + b: dw = x^T g into d[i], db = sum over rows of g into d[i + 1] (none there or None: no bias)."""
    K._mm(x.T, g, out=d[i])
    _bias_grad(d, i + 1, g)


def _bias_grad(d, i, g):
    if len(d) > i and d[i] is not None:
        K._add(g, axis=0, out=d[i])


def _embedding_grads(d, g, w, idx, pos, tie):
    d[0][...], d[1][...] = K._embed_bwd(g, None, (0, 1), *w, idx, pos).values()
    if tie is not None and (share := tie.share()) is not None:   # a tied wte's gradient: the sum of its two uses
        d[0] += share


class Alone:
    """A block not split: the tensor-parallel group of one rank (its sums are the identity), and the sequence
    whole on this rank (positions 0..T-1, the causal kernel; dropout's `drop` masks it: capstone.model.dropout)."""

    size, k, positions = 1, 1, staticmethod(lambda T: None)   # the ranks splitting the block, the sequence

    def attention(self, qkv, T, H, drop=None):
        if drop is None:
            y, saved = K._attention_fwd(qkv, T, H)
        else:
            from capstone.model import dropout
            y, saved = dropout.attention_forward(qkv, T, H, drop(np.arange(T), np.arange(T)))
        return y, (saved, drop is not None)

    def attention_back(self, g, saved, argnums, qkv, T, H):
        saved, dropped = saved
        if not dropped:
            return K._attention_bwd(g, saved, argnums, qkv, T, H)
        from capstone.model import dropout
        return {0: dropout.attention_backward(g, saved, qkv, T, H)}

    Allreduce = staticmethod(lambda buf, what, kind="": buf)     # the sum over one rank: buf as it is

    # the layers' arithmetic, one GEMM or sum each (capstone.model.exact.Exact: --deterministic's, cut canonically)
    mm, share_buffer = staticmethod(K._mm), staticmethod(np.empty_like)
    order = staticmethod(lambda a: a)                                          # rows in sample order: as they come
    dense, bias, embed = map(staticmethod, (_dense_grads, _bias_grad, _embedding_grads))
    out_pieces = staticmethod(lambda x, w, split: K._mm(x, w))   # x @ w, w's output columns cut as `split` (not here)

    def in_pieces(self, x, w, split, tp, what: str):
        """x @ w, its inner dimension cut as `split` (not here), summed over the tensor-parallel ranks `tp` (the
        allreduce named `what`)."""
        y = K._mm(x, w)
        tp.Allreduce(y, what, "tp_allreduce")
        return y

    def embed_in(self, wte, wpe, idx):
        """The token and position embeddings of idx (B, T) at this part's positions: (B*T, C)."""
        return K._embed_fwd(wte, wpe, idx, self.positions(idx.shape[1]))[0]

    def ln(self, d, i, g, xhat):
        """LayerNorm's dw = sum over rows of g * xhat into d[i], db = sum of g into d[i + 1] (as `bias`'s)."""
        self.bias(d, i, g * xhat)
        self.bias(d, i + 1, g)

    def col(self, x, w, b, split):
        """A column-parallel (or whole) layer: x @ w + b (b None: no bias)."""
        return K._biased(self.out_pieces(x, w, split), b)

    def row(self, x, w, b, tp):
        """A row-parallel layer: x @ w summed over the tensor-parallel ranks ("g"), then + b (None: no bias):
        (B*T, Cin/tp) -> (B*T, C)."""
        return K._biased(self.in_pieces(x, w, "rows", tp, "tensor-parallel allreduce of a block's output"), b)

    def col_back(self, g, x, w, put, i: int, split, tp):
        """A column-parallel layer's weights' gradients `put`; its input gradient g @ w^T, summed over `tp` ("f")."""
        put(self.dense, i, x, g, split)
        return self.in_pieces(g, w.T, split, tp, "tensor-parallel allreduce of a block's input gradient")

    def row_back(self, g, w):
        """A row-parallel layer's input gradient g @ w^T."""
        return self.out_pieces(g, w.T, "rows")

    def xent(self, z, targets, scale):
        loss, probs = K._xent_fwd(z, targets)
        return loss * scale, probs

    def share(self, gz, z_in, gwte) -> None:
        K._mm(gz.T, z_in, out=gwte)                                             # z = z_in @ wte.T: d wte = gz.T @ z_in


ALONE = WHOLE = Alone()


@functools.lru_cache(maxsize=64)
def _spans(shapes: tuple) -> tuple:
    """((start, end, shape), ...) of each shape's slice of a group's flat array (None: no slice)."""
    ends = np.cumsum([0 if shape is None else math.prod(shape) for shape in shapes]).tolist()
    return tuple(zip([0] + ends[:-1], ends, shapes))


def unpack(w: np.ndarray, shapes: tuple) -> list[np.ndarray]:
    """Views of the group's flat array w, one per shape, in order (None for an absent bias: --no-bias)."""
    return [None if shape is None else w[a:b].reshape(shape) for a, b, shape in _spans(shapes)]


def _ln_back(g, saved, w, put, i: int, cp):
    """LayerNorm: its weights' gradients d[i], d[i + 1] `put`; returns dx."""
    put(cp.ln, i, g, saved[0])
    return K._ln_bwd(g, saved, (0,), g, w, None)[0]  # the input only gives the shape


def embedding_forward(w, idx, shapes, cp=WHOLE):
    """w = [wte (V, C), wpe (>=T, C)], idx (B, T) at cp's positions -> (B*T, C), nothing saved."""
    return cp.embed_in(*unpack(w, shapes), idx), None


def embedding_backward(g, w, idx, shapes, put, cp=WHOLE, tie=None) -> None:
    """The embedding's gradient `put` (no input to differentiate), wte's with a tied head's share (`tie`) added."""
    put(cp.embed, g, unpack(w, shapes), idx, cp.positions(idx.shape[1]), tie)


def block_forward(x, w, T, H, shapes, tp, cp=WHOLE, masks=None, layer: int = 0):
    """x + attn(ln_1(x)) = x1; x1 + mlp(ln_2(x1)): (B*T, C) -> (B*T, C), H heads on this rank. `masks` (dropout's
    Masks; None: no dropout): GPT-2's dropout of block `layer` at the attention probabilities and both residuals."""
    ln1w, ln1b, aw, ab, pw, pb, ln2w, ln2b, fw, fb, mw, mb = unpack(w, shapes)
    drop = m1 = m2 = None
    if masks is not None:
        drop = masks.drop(layer, T, H, getattr(tp, "rank", 0) * H)
        m1, m2 = (cp.order(masks.channels(layer, site, T, x.shape[1])) for site in ("attn_out", "mlp_out"))
    a, s_ln1 = K._ln_fwd(x, ln1w, ln1b)
    qkv = cp.col(a, aw, ab, "heads")                                            # (B*T, 3C/tp)
    y, s_att = cp.attention(qkv, T, H, drop)                                    # (B*T, C/tp)
    x1 = x + _dropped(cp.row(y, pw, pb, tp), m1)
    m, s_ln2 = K._ln_fwd(x1, ln2w, ln2b)
    u = cp.col(m, fw, fb, "columns")                                            # (B*T, 4C/tp)
    h, t = K._gelu_fwd(u)
    return x1 + _dropped(cp.row(h, mw, mb, tp), m2), [a, s_ln1, qkv, s_att, y, m, s_ln2, h, (u, t), m1, m2]


def _dropped(a, mask):
    """a with dropout's mask applied (None: no dropout)."""
    return a if mask is None else a * mask


def block_backward(g, saved, x, w, T, H, shapes, tp, put, free: bool, cp=WHOLE):
    """The block's input gradient; each weight's gradient goes to `put(op, *operands)` (docs/design.md). With `free`
    each activation is freed once used: the MLP's are gone before the attention's temporaries exist."""
    a, s_ln1, qkv, s_att, y, m, s_ln2, h, s_fc, m1, m2 = saved
    if free:
        saved.clear()
    ln1w, _, aw, _, pw, _, ln2w, _, fw, _, mw, _ = unpack(w, shapes)
    g2 = _dropped(g, m2)                                                        # the MLP branch's gradient
    put(cp.dense, 10, h, g2, "rows")                                            # the row layer's, with h freed
    del h, m2                                                                   # before gh exists: 3.6 MiB
    gh = cp.row_back(g2, mw)                                                    # less peak RSS at medium
    del g2                                                                      # (B*T, 4C/tp)
    gm = cp.col_back(K._gelu_grad(gh, *s_fc, out=gh), m, fw, put, 8, "columns", tp)   # through the MLP
    del gh, s_fc, m
    gx1 = g + _ln_back(gm, s_ln2, ln2w, put, 6, cp)
    del gm, s_ln2
    gy = _dropped(gx1, m1)
    put(cp.dense, 4, y, gy, "rows")
    gqkv = cp.attention_back(cp.row_back(gy, pw), s_att, (0,), qkv, T, H)[0]
    del s_att, y, qkv, m1, gy
    ga = cp.col_back(gqkv, a, aw, put, 2, "heads", tp)
    return gx1 + _ln_back(ga, s_ln1, ln1w, put, 0, cp)


def head_logits(x, w, shapes, wte=None, cp=WHOLE):
    """Logits (B*T, V) of the final hidden states x (B*T, C): w = [ln_f.w, ln_f.b, lm_head.w(, lm_head.b)]; tied
    (--tie-embeddings, capstone.model.tied): w = [ln_f.w, ln_f.b(, lm_head.b)], the head wte.T, wte (V, C)."""
    lnw, lnb, *rest = unpack(w, shapes)                          # rest: [lm_head.w (untied)] + [lm_head.b (if any)]
    hw, hb = (rest[0], rest[1:]) if wte is None else (wte.T, rest)            # hb: [] with --no-head-bias
    z_in, s_ln = K._ln_fwd(x, lnw, lnb)
    return K._biased(cp.mm(z_in, hw), *hb), (z_in, s_ln)


def head_loss_forward(x, w, targets, shapes, scale=1.0, wte=None, cp=WHOLE):
    """scale * (sum over the rows of the cross-entropy of the logits against targets (B*T,)) -> scalar."""
    z, (z_in, s_ln) = head_logits(x, w, shapes, wte, cp)
    loss, probs = cp.xent(z, targets, scale)
    return loss, [z_in, s_ln, probs]


def head_loss_backward(g, saved, w, targets, shapes, put, free: bool, scale=1.0, wte=None, gwte=None, cp=WHOLE):
    """The hidden states' gradient (`free`: as block_backward); the head's weights' `put`; a tied head's share: gwte."""
    z_in, s_ln, probs = saved
    if free:
        saved.clear()
    gz = K._xent_grad_inplace(probs if free else probs.copy(), cp.order(targets), g * scale)   # over it if owned
    if wte is None:
        lnw, _, hw, *_ = unpack(w, shapes)
        put(cp.dense, 2, z_in, gz)
        return _ln_back(cp.mm(gz, hw.T), s_ln, lnw, put, 0, cp)
    cp.share(gz, z_in, gwte)
    put(cp.bias, 2, gz)
    return _ln_back(cp.mm(gz, wte), s_ln, unpack(w, shapes)[0], put, 0, cp)
