"""Hand-written VJPs for MiniGPT's ops: autograd primitives over plain NumPy
(docs/design.md, "Inside the step", model/kernels.py)."""

import functools
import math

import numpy as np
from autograd.extend import defvjp_argnums, primitive

GELU_K = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
ROW_BLOCK = 1 << 16  # elements per row block of the GELU's and LayerNorm's passes: 256 KiB per array, in L2
ATTN_BLOCK = 64      # query rows per block of the causal attention: a block sees only the keys up to its end

_add, _max = np.add.reduce, np.maximum.reduce  # ndarray.sum / .max without their Python wrapper
_mm = np.matmul  # every matmul of the kernels (and capstone.model.blocks) goes through this name (benchmarks time it)


def define(name, forward, backward):
    """Primitive `name` of forward(*a, **kw) -> (out, saved) and backward(g, saved, argnums, *a, **kw) -> {i: grad}."""
    stash = [None]   # (output, saved) of this primitive's most recent forward

    def raw(*args, **kwargs):
        stash[0] = forward(*args, **kwargs)
        return stash[0][0]

    raw.__name__, raw.__qualname__, raw.__doc__ = name, name, forward.__doc__
    op = primitive(raw)

    def vjpmaker(argnums, ans, args, kwargs):  # autograd calls this right after `raw`, with its output
        slot, stash[0] = stash[0], None
        saved = slot[1] if slot is not None and slot[0] is ans else forward(*args, **kwargs)[1]

        def vjp(g):
            grads = backward(g, saved, argnums, *args, **kwargs)
            return tuple(grads[i] for i in argnums)
        return vjp

    defvjp_argnums(op, vjpmaker)
    return op


@functools.lru_cache(maxsize=8)
def causal_mask(T: int) -> np.ndarray:
    """(T, T) additive mask, 0 on and below the diagonal, -inf above: built once per T, read-only."""
    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)
    mask.flags.writeable = False
    return mask


def _embed_fwd(wte, wpe, idx, pos=None):
    """Token + position embedding: wte (V, C), wpe (>=T, C), idx (B, T) at `pos` (None: 0..T-1) -> (B*T, C)."""
    B, T = idx.shape
    return (wte[idx] + wpe[slice(T) if pos is None else pos]).reshape(B * T, wte.shape[1]), None


def _embed_bwd(g, _, argnums, wte, wpe, idx, pos=None):
    out = {}
    if 0 in argnums:  # scatter-add rows of g by token id: sort, then one reduceat (beats np.add.at)
        order = np.argsort(idx.reshape(-1), kind="stable")
        sorted_ids = idx.reshape(-1)[order]
        starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
        out[0] = np.zeros_like(wte)
        out[0][sorted_ids[starts]] = np.add.reduceat(g[order], starts, axis=0)
    if 1 in argnums:
        out[1] = np.zeros_like(wpe)
        out[1][slice(idx.shape[1]) if pos is None else pos] = np.add.reduce(g.reshape(*idx.shape, -1), axis=0)
    return out


def _row_blocks(u):
    """Slices of u's first axis of about ROW_BLOCK elements (0-d, 1-d u: one), so a block's several passes run in L2."""
    if u.ndim < 2:
        return [Ellipsis]
    rows = max(1, ROW_BLOCK // max(1, u[0].size))
    return [slice(s, s + rows) for s in range(0, len(u), rows)]


def _rowdot(a, b):
    """Sum over the last axis of a * b, without a temporary of a's size: (..., C) -> (..., 1)."""
    return np.einsum("...i,...i->...", a, b)[..., None]


def _ln_fwd(x, w, b, eps=1e-5):
    """LayerNorm over the last axis, in row blocks: x (..., C), w/b (C,) (b None: no bias); saves xhat and 1/std."""
    inv_c, rstd = 1.0 / x.shape[-1], np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    xhat, y = np.empty_like(x), np.empty_like(x, dtype=np.result_type(x, w, *(() if b is None else (b,))))
    for r in _row_blocks(x):
        xh, xr, rs, yr = xhat[r], x[r], rstd[r], y[r]
        np.subtract(xr, _add(xr, axis=-1, keepdims=True) * inv_c, out=xh)
        np.divide(1.0, np.sqrt(_rowdot(xh, xh) * inv_c + eps), out=rs)
        xh *= rs
        _biased(np.multiply(xh, w, out=yr), b)
    return y, (xhat, rstd)


def _ln_bwd(g, saved, argnums, x, w, b, eps=1e-5):
    xhat, rstd = saved
    inv_c = 1.0 / x.shape[-1]
    lead = tuple(range(x.ndim - 1))
    sums = {1: lambda: _add(g * xhat, axis=lead), 2: lambda: _add(g, axis=lead)}   # dw, db
    out = {i: sums[i]() for i in (1, 2) if i in argnums}
    if 0 in argnums:  # dx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)), gxhat = g * w
        out[0] = gx = np.empty_like(g, dtype=np.result_type(g, w))
        for r in _row_blocks(g):                        # row by row: in blocks from cache
            gr, xh = gx[r], xhat[r]
            np.multiply(g[r], w, out=gr)
            mean_gx = _rowdot(gr, xh) * inv_c
            gr -= _add(gr, axis=-1, keepdims=True) * inv_c
            gr -= xh * mean_gx
            gr *= rstd[r]
    return out


def _biased(y, b=None):
    """y + b, added into y in place (b None or not given: no bias); returns y."""
    if b is not None:
        y += b
    return y


def _linear_fwd(x, w, b):
    """y = x @ w + b: x (N, Cin), w (Cin, Cout), b (Cout,) or None -> (N, Cout)."""
    return _biased(_mm(x, w), b), None


def _gelu_fwd(u):
    """GELU, tanh approximation (GPT-2), any shape: 0.5 u (1 + t), t = tanh(K (u + A u^3)); saves 1 + t."""
    t, y = np.empty_like(u), np.empty_like(u)
    for r in _row_blocks(u):
        ur, tr, yr = u[r], t[r], y[r]
        np.multiply(ur, ur, out=tr)
        tr *= GELU_A
        tr += 1.0
        tr *= ur
        tr *= GELU_K
        np.tanh(tr, out=tr)
        tr += 1.0                                       # 1 + t
        np.multiply(tr, ur, out=yr)
        yr *= 0.5
    return y, t


def _gelu_grad(g, u, tp, out=None):
    """g * gelu'(u) = g (1 + t) (0.5 + 0.5 u (1 - t) K (1 + 3 A u^2)), tp = 1 + t, into `out` (may be g; None: new)."""
    out = np.empty_like(u) if out is None else out
    for r in _row_blocks(u):
        d = u[r] * u[r]
        d *= 1.5 * GELU_A * GELU_K
        d += 0.5 * GELU_K
        d *= u[r]                                       # 0.5 u dz/du
        d *= 2.0 - tp[r]                                # 1 - t
        d += 0.5
        d *= tp[r]
        np.multiply(d, g[r], out=out[r])
    return out


def _split_heads(qkv, T, H):
    """qkv (B*T, 3C) -> q, k, v views of shape (B, H, T, D)."""
    return tuple(qkv.reshape(len(qkv) // T, T, 3, H, -1).transpose(2, 0, 3, 1, 4))  # from (3, B, H, T, D)


def _heads(a, B, T, H):
    """(B*T, C) -> (B, H, T, D) view."""
    return a.reshape(B, T, H, -1).transpose(0, 2, 1, 3)


def _against(g, y, T, H):
    """The output's gradient g (B*T, C) as gy (B, H, T, D), and each row's gy . y (B, H, T, 1)."""
    gy = _heads(g, len(g) // T, T, H)
    return gy, _rowdot(gy, _heads(y, len(g) // T, T, H))


def _query_blocks(T):
    """[(start, end)] of the query blocks: at T = n * ATTN_BLOCK, (n + 1) / 2n of the (T, T) work (5/8 at n = 4)."""
    step = ATTN_BLOCK if T >= 2 * ATTN_BLOCK else T
    return [(s, min(T, s + step)) for s in range(0, T, step)]


def _attention_fwd(qkv, T, H):
    """softmax(q k^T / sqrt(D) + causal) v per head: qkv (B*T, 3C) -> (B*T, C); saves each block's E, 1/sum and y."""
    q, k, v = _split_heads(qkv, T, H)
    B, _, _, D = q.shape
    qs = q * (1.0 / math.sqrt(D))                                # (B, H, T, D), contiguous
    y = np.empty((B, T, H, D), dtype=qs.dtype)
    yh, saved = y.transpose(0, 2, 1, 3), []                      # yh: (B, H, T, D) view of the output
    for s, e_ in _query_blocks(T):
        e = _mm(qs[:, :, s:e_], k[:, :, :e_].swapaxes(-1, -2))   # S: (B, H, e - s, e)
        e[..., s:] += causal_mask(e_ - s)
        e -= _max(e, axis=-1, keepdims=True)                       # shift-invariant: exact
        np.exp(e, out=e)
        r = np.reciprocal(_add(e, axis=-1, keepdims=True))
        out = _mm(e, v[:, :, :e_], out=yh[:, :, s:e_])
        out *= r
        saved.append((s, e_, e, r))
    y = y.reshape(B * T, H * D)
    return y, (saved, y)


def _attention_bwd(g, saved, argnums, qkv, T, H):
    blocks, y = saved
    q, k, v = _split_heads(qkv, T, H)
    B, _, _, D = q.shape
    gy, dot = _against(g, y, T, H)                               # (B, H, T, D), gy_i . y_i: (B, H, T, 1)
    gqkv = np.empty((B, T, 3, H, D), dtype=np.result_type(qkv, g))
    gq, gk, gv = (gqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, H, T, D) views
    for s, e_, e, r in reversed(blocks):                         # the last block sees every key: written first
        gyr = gy[:, :, s:e_] * r                                 # gy_i / sum_i
        ds = _mm(gyr, v[:, :, :e_].swapaxes(-1, -2))             # dP / sum: (B, H, e - s, e)
        ds -= dot[:, :, s:e_] * r
        ds *= e                                                  # dS; masked entries stay 0
        _mm(ds, k[:, :, :e_], out=gq[:, :, s:e_])
        if e_ == T:
            _mm(ds.swapaxes(-1, -2), q[:, :, s:e_], out=gk)
            _mm(e.swapaxes(-1, -2), gyr, out=gv)                 # P^T gy
        else:
            gk[:, :, :e_] += _mm(ds.swapaxes(-1, -2), q[:, :, s:e_])
            gv[:, :, :e_] += _mm(e.swapaxes(-1, -2), gyr)
    gqkv[:, :, :2] *= 1.0 / math.sqrt(D)                         # d S / d (q k^T)
    return {0: gqkv.reshape(qkv.shape)}


def _xent_rows(z, targets):
    """Each row's -log softmax(z)[target]: z (N, V), targets (N,) ints -> (N,); and the softmax."""
    zs = z - _max(z, axis=1, keepdims=True)
    e = np.exp(zs)
    s = _add(e, axis=1, keepdims=True)                           # (N, 1)
    rows = np.log(s[:, 0]) - zs[np.arange(z.shape[0]), targets]
    e /= s
    return rows, e


def _xent_fwd(z, targets):
    """Sum over rows of -log softmax(z)[target] -> scalar; saves softmax."""
    rows, e = _xent_rows(z, targets)
    return rows.sum(), e


def _xent_grad_inplace(probs, targets, g):
    """The gradient g (softmax - onehot(targets)) of the summed loss, written over probs (N, V)."""
    probs[np.arange(probs.shape[0]), targets] -= 1.0
    probs *= g
    return probs
