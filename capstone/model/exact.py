"""--deterministic's arithmetic: every sum that a layout could cut is cut the same way on every layout.

The plan's split count S (`--det-split`, capstone.plan) fixes two canonical cuts of the model's sums:

- *Pieces.* Every contraction that tensor parallelism cuts is P = gcd(S, n_heads) partial products:
  a row-parallel layer (both c_proj) and a column-parallel layer's input gradient (c_attn, c_fc)
  add P products over P pieces of the split dimension (c_attn: P groups of whole heads), in the
  fixed tree over the piece index, a tensor-parallel rank of tp holding P/tp pieces (its subtree) and the ranks'
  subtrees added in the same tree after one allgather. A column-parallel output and every weight
  gradient are computed piece by piece, so the GEMMs have the same shapes also at tp 1.
- *Chunks.* Each sequence is S chunks of n = T/S positions. The activations' rows are chunk-major
  (`Exact.order`: the embedding makes them so, and the targets and dropout's masks are put in that
  order), so every GEMM over tokens runs on one chunk's rows of every sample (B*n rows, a view),
  and every sum over tokens (each weight gradient, LayerNorm's and the
  biases' gradients, the embeddings' scatter-add, the loss) is taken per chunk of the micro-batch
  and added in the chunk tree: chunks q and S-1-q first (a *pair*), then the stride tree over the
  pair index. Context-parallel rank c of k holds the pairs [c S/2k, (c+1) S/2k) (its ring chunks
  c and 2k-1-c: capstone.model.ring), so it sums its subtree and the deterministic reducer adds the
  ranks' rows in the same tree (capstone.parallel.deterministic: rows of a block are adjacent).
- Attention (`Exact.attention`): each query chunk merges its key chunks' partial softmax results
  (running max, sum, output) in chunk-index order, tile by tile; under --cp the keys and values
  are allgathered over the ring, and each key chunk's gradient is the chunk tree over the query
  chunks, the ranks' subtrees sent to its owner (one Alltoall) and added in the same tree.

tp (dividing P) and 2 cp (dividing S) are powers of two, so that every subtree is a subtree of the one tree.
docs/deterministic.md has the proof.
"""

import math

import numpy as np

from capstone.model import kernels as K
from capstone.model.blocks import Alone
from capstone.model.ring import merge, merged, opened, qkv_grad, tile_back


def tree(leaves: list):
    """The fixed tree over leaf indices: at stride 1, 2, 4, ... leaf i += leaf i+stride (i a multiple of 2 stride);
    an array leaf is added into in place (its buffer is overwritten), a scalar's sum is a new scalar."""
    for stride in (1 << j for j in range((len(leaves) - 1).bit_length())):      # 1, 2, 4, ... below len(leaves)
        for i in range(0, len(leaves) - stride, 2 * stride):
            leaves[i] = np.add(leaves[i], leaves[i + stride], out=leaves[i] if np.ndim(leaves[i]) else None)
    return leaves[0]


def held(S: int, k: int, c: int) -> list[int]:
    """The chunks (of S) that cp rank c of k holds, in its rows' order: its ring chunks c and 2k-1-c, S/2k each."""
    m = S // (2 * k)
    return [*range(c * m, (c + 1) * m), *range((2 * k - 1 - c) * m, (2 * k - c) * m)]


_c = np.ascontiguousarray


class Exact(Alone):
    """The blocks' arithmetic in S pieces and S chunks (see the module), over tensor-parallel group `tp`
    and the context-parallel `ring` (capstone.model.ring.Ring; None: the sequence whole)."""

    def __init__(self, S: int, T: int, heads: int, tp, ring=None):
        k, c = (1, 0) if ring is None else (ring.k, ring.c)
        self.S, self.n, self.tp, self.ring, self.k, self.P = S, T // S, tp, ring, k, math.gcd(S, heads) // tp.size
        self.held = held(S, k, c)                                              # its chunks, in row order
        self.L, at, m = len(self.held), {q: i for i, q in enumerate(self.held)}, S // (2 * k)
        self.pairs = [(at[p], at[S - 1 - p]) for p in range(c * m, (c + 1) * m)]   # this rank's pairs, in order

    # ---- the two cuts -------------------------------------------------------------------------

    def tsum(self, f):
        """The chunk tree of f(l) over this rank's chunks l (local order): pairs, then their stride tree."""
        return tree([f(i) + f(j) for i, j in self.pairs])

    def across(self, y: np.ndarray) -> np.ndarray:
        """The piece tree's top: the tensor-parallel ranks' subtrees y, allgathered, added in rank order."""
        if self.tp.size == 1:
            return y
        every = np.empty((self.tp.size,) + y.shape, dtype=y.dtype)
        self.tp.Allgather(every, "deterministic tensor-parallel allgather of partial products", "tp_allreduce",
                          send=_c(y))
        return tree(list(every))

    def pieces(self, width: int, split: str) -> list:
        """This rank's S/tp pieces of a split dimension of `width` (heads: [q_s | k_s | v_s] of fused qkv)."""
        if split == "heads":
            c, n = width // 3, width // 3 // self.P
            return [np.concatenate([j * c + s * n + np.arange(n) for j in range(3)]) for s in range(self.P)]
        n = width // self.P
        return [slice(s * n, (s + 1) * n) for s in range(self.P)]

    def order(self, a: np.ndarray, back: bool = False) -> np.ndarray:
        """Rows (or a vector) in sample order (B, t) -> this arithmetic's order: chunk-major (L, B, n), so that
        local chunk l's rows of every sample are one contiguous GEMM tile of B*n rows (`chunks`); `back`: undone."""
        lead = (self.L, -1) if back else (-1, self.L)
        out = _c(a.reshape(*lead, self.n, *a.shape[1:]).swapaxes(0, 1)).reshape(a.shape)
        out.flags.writeable = a.flags.writeable      # dropout's masks stay read-only (capstone.model.precision)
        return out

    def chunks(self, x: np.ndarray) -> np.ndarray:
        """(B*t, C) in chunk-major order -> (L, B*n, C), a view."""
        return x.reshape(self.L, -1, x.shape[-1])

    def rows(self, y: np.ndarray) -> np.ndarray:
        """`chunks`' inverse: (L, B*n, N) -> (B*t, N)."""
        return y.reshape(-1, y.shape[-1])

    def embed_in(self, wte, wpe, idx):
        """The embeddings of idx (B, t), in chunk-major order: (B*t, C)."""
        pos = np.array([np.arange(q * self.n, (q + 1) * self.n) for q in self.held])[:, None]   # (L, 1, n)
        return (wte[self.order(idx.reshape(-1)).reshape(self.L, -1, self.n)] + wpe[pos]).reshape(-1, wte.shape[1])

    def mm(self, x, w):
        """x @ w per chunk tile: (B*t, Cin) -> (B*t, Cout)."""
        return self.rows(K._mm(self.chunks(x), w))

    # ---- the layers (capstone.model.blocks.Alone's interface) -----------------------------------

    def out_pieces(self, x, w, split):
        """x @ w per chunk tile, w's output columns piece by piece (`pieces` of `split`): (B*t, Cin) -> (B*t, Cout)."""
        xs = self.chunks(x)
        out = np.empty(xs.shape[:2] + (w.shape[1],), dtype=np.result_type(x, w))
        for cols in self.pieces(w.shape[1], split):
            out[..., cols] = K._mm(xs, _c(w[:, cols]))
        return self.rows(out)

    def in_pieces(self, x, w, split, tp, what: str):
        """x @ w per chunk tile as the piece tree of its partial products over the `split` pieces of x's columns
        (w's rows), added across the tensor-parallel ranks: (B*t, Cin/tp) -> (B*t, Cout)."""
        parts = [K._mm(self.chunks(x)[..., r], _c(w[r])) for r in self.pieces(x.shape[1], split)]
        return self.rows(self.across(tree(parts)))

    def dense(self, d, i, x, g, split=None):
        """Weight gradient x^T g piece by piece, each the chunk tree of the chunks' GEMMs; the bias's likewise."""
        xs, gs, every = self.chunks(x), self.chunks(g), [slice(None)]
        ins = self.pieces(x.shape[1], "rows") if split == "rows" else every          # a row-parallel layer's
        outs = every if split in (None, "rows") else self.pieces(g.shape[1], split)  # a column-parallel layer's
        for a in ins:
            for c in outs:
                prod = K._mm(xs[..., a].transpose(0, 2, 1), gs[..., c])      # (L, piece of Cin, piece of Cout)
                d[i][a, c] = self.tsum(lambda l: prod[l])
        self.bias(d, i + 1, g)

    def bias(self, d, i, g):
        if len(d) > i and d[i] is not None:
            sums = K._add(self.chunks(g), axis=1)
            d[i][...] = self.tsum(lambda l: sums[l])

    def xent(self, z, targets, scale):
        """(the chunk tree of each chunk's float32 loss sum as float64 times scale, softmax)."""
        rows, e = K._xent_rows(z, self.order(targets))
        return self.tsum(lambda l: np.float64(K._add(rows.reshape(self.L, -1)[l])) * scale), e

    def share_buffer(self, wte):
        return np.empty((self.L,) + wte.shape, dtype=wte.dtype)

    def share(self, gz, z_in, gwte) -> None:
        """A tied head's share of wte's gradient, per chunk (added to the embedding's chunk by chunk)."""
        K._mm(self.chunks(gz).transpose(0, 2, 1), self.chunks(z_in), out=gwte)

    def embed(self, d, g, w, idx, pos, tie):
        """wte's gradient: each chunk's scatter-add (and a tied head's share), in the chunk tree; wpe's per position."""
        share = None if tie is None else tie.share()
        B, n, gs = idx.shape[0], self.n, self.chunks(g)

        def leaf(l):
            out = K._embed_bwd(gs[l], None, (0,), *w, _c(idx.reshape(B, self.L, n)[:, l]))[0]
            return out if share is None else out + share[l]
        d[0][...] = self.tsum(leaf)
        d[1][...] = 0.0
        for l, q in enumerate(self.held):
            d[1][q * n:(q + 1) * n] = K._add(gs[l].reshape(B, n, -1), axis=0)

    # ---- attention ----------------------------------------------------------------------------

    def _kv(self, kv) -> np.ndarray:
        """(2, B, H, S n, D): every chunk's keys and values kv in chunk order (under --cp, allgathered)."""
        if self.ring is None:
            return kv
        every = np.empty((self.k,) + kv.shape, dtype=kv.dtype)
        self.ring.cp.Allgather(every, "deterministic context-parallel allgather of keys and values", "cp_ring",
                               send=_c(kv))
        n, at = self.n, {q: (r, l) for r in range(self.k) for l, q in enumerate(held(self.S, self.k, r))}
        return np.concatenate([every[r][..., l * n:(l + 1) * n, :] for r, l in map(at.get, range(self.S))], axis=3)

    def _tiles(self, qs, kv, drop):
        """(local query chunk, its query rows, key rows, scores, dropout keep or None) of every tile,
        query chunk by chunk and within a tile key chunk by key chunk, in index order (a diagonal tile masked)."""
        n = self.n
        for l, a in enumerate(self.held):
            for r in range(0, n, K.ATTN_BLOCK):
                e = min(n, r + K.ATTN_BLOCK)
                rows = slice(l * n + r, l * n + e)
                for b in range(a + 1):
                    keys = slice(b * n, b * n + (e if b == a else n))
                    s = K._mm(qs[:, :, rows], kv[0][:, :, keys].swapaxes(-1, -2))
                    if b == a:
                        s += K.causal_mask(n)[r:e, :e]
                    yield l, rows, keys, s, None if drop is None else drop(np.arange(a * n + r, a * n + e),
                                                                           np.arange(keys.start, keys.stop))

    def attention(self, qkv, t: int, h: int, drop=None):
        qs, kv = opened(self.order(qkv, back=True), t, h)                      # in sample order from here
        kv, acc = self._kv(kv), {}
        for _, rows, keys, s, keep in self._tiles(qs, kv, drop):
            acc[rows.start] = merge(acc.get(rows.start), s, kv[1][:, :, keys], keep)
        y, lse = merged(acc)
        return self.order(y), (lse, y, drop)

    def attention_back(self, g, saved, argnums, qkv, t: int, h: int):
        (lse, y, drop), g, (qs, kv) = saved, self.order(g, back=True), opened(self.order(qkv, back=True), t, h)
        kv, (gy, dot), gq = self._kv(kv), K._against(g, y, t, h), np.zeros_like(qs)
        parts, n = np.zeros((self.L,) + kv.shape, dtype=kv.dtype), self.n         # query chunk l's share, every key
        for l, rows, keys, s, keep in self._tiles(qs, kv, drop):
            tile_back(s, keep, rows, keys, qs, kv, lse, gy, dot, gq, parts[l][..., keys, :])
        dkv = self._home(np.stack([self.tsum(lambda l, b=b: parts[l, ..., b * n:b * n + n, :]) for b in range(self.S)]))
        return {0: self.order(qkv_grad(gq, dkv.transpose(2, 0, 4, 1, 3, 5), qkv, g))}

    def _home(self, sub: np.ndarray) -> np.ndarray:
        """(L, 2, B, H, n, D): this rank's key chunks' gradients, the ranks' subtrees `sub` (S, ...) sent to each
        chunk's owner and added in rank order (the top of the chunk tree)."""
        if self.ring is None:
            return sub
        send = _c(np.stack([sub[held(self.S, self.k, r)] for r in range(self.k)]))
        got = np.empty_like(send)
        self.ring.cp.Alltoall(send, got, "deterministic context-parallel exchange of key and value gradients",
                              "cp_ring")
        return np.stack([tree(list(got[:, l])) for l in range(self.L)])

