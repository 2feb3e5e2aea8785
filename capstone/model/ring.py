"""Context parallelism (--cp K): each sequence split over the K ranks of the grid's cp axis, with
causal ring attention, imported only when cp > 1.

The balanced split (Megatron-LM's, torchtitan's): a sequence of T positions is 2K chunks of
n = T / 2K; cp rank c holds chunks c and 2K-1-c (`chunks`), its 2n rows of inputs and targets
(`Chunks`, the data) at their real positions (`Ring.positions`, the position embedding). Under a
causal mask query chunk a sees key chunks b <= a, so rank c computes (c + 1) + (2K - c) = 2K + 1
chunk-by-chunk blocks whatever c is (`blocks`); the naive split (rank c: chunks 2c, 2c+1) gives
rank c 4c + 3, the last rank 4K - 1 against the first's 3.

Everything but attention is per token. Attention (`Ring.attention`): each rank keeps its queries
and passes its keys and values round the ring (to rank c+1, from c-1, non-blocking through the cp
`Comm` under the deadline), the next block's transfer in flight while the current block is
computed; the blocks are merged with the running maximum and sum of exponentials (`merge`), so
the result is the softmax over every key. Per layer it keeps the output and the log-sum-exp of
each query row (B, H, 2n, 1): linear in T, where the whole-sequence kernel keeps each query block's
exponentials, (B, H, T, T) halved by the causal blocks. The backward (`Ring.attention_back`)
recomputes each block's probabilities from the log-sum-exp, passes the keys and values round again,
and the key and value gradients travel with them, each rank adding its part, one more hop bringing
them home to their owner. With --dropout (capstone.model.dropout) each tile's probabilities are
masked at their global (query, key) positions, forward and backward: dropout(softmax(s)) v, so the
mask multiplies the output's exponentials while the sum of exponentials, the log-sum-exp, stays
the undropped one.

Bytes sent per rank per attention layer, with S = 4 B (H / tp) 2n D (one float32 tensor of the
rank's keys): forward 2 S (K - 1) (keys and values, K - 1 hops), backward 2 S (K - 1) + 2 S K (the
keys and values again, their gradients K hops).
"""

import math

import numpy as np

from capstone.model import kernels as K
from capstone.model.blocks import Alone

TAG = 7100   # + the hop: the ring's messages on the cp communicator
TILE = 64    # query rows at a time within a chunk block: its temporaries are (B, H, TILE, n), not (B, H, n, n)


def chunks(c: int, k: int) -> tuple[int, int]:
    """The two chunks (of 2k) of a sequence that cp rank c of k holds: c and 2k-1-c."""
    return c, 2 * k - 1 - c


def blocks(k: int, owned=chunks) -> list[int]:
    """Per cp rank, the query-key chunk blocks its causal attention computes (`owned(c, k)`: its chunks)."""
    return [sum(b <= a for a in owned(c, k) for src in range(k) for b in owned(src, k)) for c in range(k)]


def merge(acc, s, v, keep=None):
    """Fold one block (scores s (.., q, keys), values v) into acc = [output, running max, sum of
    exponentials] (None: the first block): both sides rescaled to the larger maximum. `keep`: the
    block's dropout mask (0 or 1/(1-p)), on the output's exponentials only: dropout(softmax(s)) v
    divides the dropped numerator by the undropped sum."""
    m = np.maximum.reduce(s, axis=-1, keepdims=True)
    p = np.exp(s - m)
    block = [K._mm(p if keep is None else p * keep, v), m, np.add.reduce(p, axis=-1, keepdims=True)]
    if acc is None:
        return block
    o, mo, lo = acc
    top = np.maximum(mo, m)
    a, b = np.exp(mo - top), np.exp(m - top)
    return [o * a + block[0] * b, top, lo * a + block[2] * b]


def opened(qkv, t: int, h: int):
    """qkv (B*t, 3C) -> its queries scaled by 1/sqrt(D) (B, H, t, D), its keys and values stacked (2, B, H, t, D)."""
    q, k, v = K._split_heads(qkv, t, h)
    return q * (1.0 / math.sqrt(q.shape[-1])), np.stack([k, v])


def merged(acc: dict):
    """The output (B*t, C) and each query row's log-sum-exp (B, H, t, 1) of the tiles `merge`d into
    acc (the start of a tile's query rows -> its [output, running max, sum of exponentials])."""
    parts = [acc[start] for start in sorted(acc)]                          # the tiles in row order
    yh = np.concatenate([o / l for o, _, l in parts], axis=2)             # (B, H, t, D)
    lse = np.concatenate([m + np.log(l) for _, m, l in parts], axis=2)
    return np.ascontiguousarray(yh.transpose(0, 2, 1, 3)).reshape(-1, yh.shape[1] * yh.shape[3]), lse


def tile_back(s, keep, qi, ki, qs, kv, lse, gy, dot, gq, gkv) -> None:
    """One tile's backward from its scores s (.., q, keys) at query rows qi and key rows ki of the scaled queries qs,
    the keys and values kv, the rows' log-sum-exp, gy and gy . y (kernels' `_against`), the probabilities again
    from the log-sum-exp: d queries added into gq's rows qi, d keys and d values into gkv (2, .., keys, D). With
    dropout's `keep` (D, P the undropped probabilities, y = (D P) v): dv = (D P)^T gy and
    ds = P (D (gy v^T) - gy . y)."""
    p = np.exp(s - lse[:, :, qi])
    dv = K._mm((p if keep is None else p * keep).swapaxes(-1, -2), gy[:, :, qi])
    ds = K._mm(gy[:, :, qi], kv[1][:, :, ki].swapaxes(-1, -2))
    if keep is not None:
        ds *= keep
    ds -= dot[:, :, qi]
    ds *= p
    gq[:, :, qi] += K._mm(ds, kv[0][:, :, ki])
    gkv[0] += K._mm(ds.swapaxes(-1, -2), qs[:, :, qi])
    gkv[1] += dv


def qkv_grad(gq, gkv, qkv, g) -> np.ndarray:
    """The gradient of qkv from the scaled queries' gq (B, H, t, D) and the keys' and values' gkv (B, t, 2, H, D)."""
    bsz, h, t, d = gq.shape
    gqkv = np.empty((bsz, t, 3, h, d), dtype=np.result_type(qkv, g))
    gqkv[:, :, 0] = (gq * (1.0 / math.sqrt(d))).transpose(0, 2, 1, 3)
    gqkv[:, :, 1:] = gkv.reshape(bsz, t, 2, h, d)
    return gqkv.reshape(qkv.shape)


class Ring(Alone):
    """The cp group's attention and positions, handed to the blocks through the model's `Pass`
    (capstone.model.backward): the sequence's part on this rank is chunks `chunks(rank, size)`."""

    def __init__(self, cp):
        self.cp, self.k, self.c = cp, cp.size, cp.rank
        self.prev, self.next = (self.c - 1) % self.k, (self.c + 1) % self.k     # the ring's neighbours
        self.computed = 0     # query-key chunk blocks computed so far (forward), for the tests

    def part(self, a: np.ndarray) -> np.ndarray:
        """This rank's rows of a (B, T) array of whole sequences: (B, 2n)."""
        return a[:, self.positions(a.shape[1] // self.k)]

    def positions(self, t: int, c: int | None = None) -> np.ndarray:
        """The real positions of the t = 2n rows of cp rank c (None: this rank)."""
        n = t // 2
        return np.concatenate([np.arange(i * n, (i + 1) * n) for i in chunks(self.c if c is None else c, self.k)])

    def _tiles(self, qs, kv, src: int, t: int, drop):
        """(query rows, key rows, scores, dropout mask) of the tiles of the causal blocks between this rank's chunks
        and src's (whose keys and values are kv), TILE query rows at a time; on a diagonal block only
        the keys up to the tile's last row, masked above the diagonal. The mask (None: no dropout): `drop` at the
        tile's queries' and keys' real positions."""
        n = t // 2
        for i, a in enumerate(chunks(self.c, self.k)):
            for j, b in enumerate(chunks(src, self.k)):
                for r in range(0, n, TILE) if b <= a else ():
                    e = min(n, r + TILE)
                    qi, ki = slice(i * n + r, i * n + e), slice(j * n, j * n + e if a == b else (j + 1) * n)
                    s = K._mm(qs[:, :, qi], kv[0][:, :, ki].swapaxes(-1, -2))
                    if a == b:
                        s += K.causal_mask(n)[r:e, :e]
                    yield qi, ki, s, None if drop is None else drop(self.positions(t)[qi], self.positions(t, src)[ki])

    def _shift(self, send: np.ndarray, hop: int):
        """Start sending `send` to the next rank and receiving its like from the previous one."""
        got = np.empty(send.shape, dtype=send.dtype)
        return got, [self.cp.Irecv(got, self.prev, TAG + hop), self.cp.Isend(send, self.next, TAG + hop)]

    def _wait(self, recv, send, nbytes: int, what: str, hop: int) -> None:
        """Wait for a shift's receive, then its send, each named by its peer: a stopped rank stalls
        the receive of the rank after it and, past MPI's eager size, the send of the rank before."""
        name = f"context-parallel ring attention: {what} of hop {hop}"
        self.cp.wait(recv, f"{name} from cp rank {self.prev}", "cp_ring", "p2p", nbytes)
        self.cp.wait(send, f"{name} to cp rank {self.next}", "cp_ring", "p2p")

    def _hops(self, kv):
        """(hop, the rank whose keys and values these are, kv) round the ring: each hop's are sent on, and the
        next hop's received, while the caller computes with them."""
        for hop in range(self.k - 1):
            nxt, reqs = self._shift(kv, hop)
            yield hop, (self.c - hop) % self.k, kv
            self._wait(*reqs, kv.nbytes, "keys and values", hop)
            kv = nxt
        yield self.k - 1, self.next, kv      # the last hop's: nothing to send on

    def attention(self, qkv, t: int, h: int, drop=None):
        """Causal softmax attention of this rank's rows over the whole sequence: qkv (B*t, 3C) ->
        (B*t, C), saving (log-sum-exp, output, drop). `drop` (capstone.model.dropout.Masks.drop):
        the probabilities' dropout mask at (query positions, key positions), None: no dropout."""
        (qs, kv), acc = opened(qkv, t, h), {}
        for _, src, kv in self._hops(np.ascontiguousarray(kv)):
            for qi, ki, s, keep in self._tiles(qs, kv, src, t, drop):
                acc[qi.start] = merge(acc.get(qi.start), s, kv[1][:, :, ki], keep)
                self.computed += qi.start % (t // 2) == 0          # a chunk block's first tile
        y, lse = merged(acc)
        return y, (lse, y, drop)

    def attention_back(self, g, saved, argnums, qkv, t: int, h: int):
        """{0: the gradient of qkv}: each block's probabilities again from the log-sum-exp, the key and
        value gradients passed round the ring with the keys and values to their owner. With dropout
        (D the mask, P the undropped probabilities, y = (D P) v): dv = (D P)^T gy and
        ds = P (D (gy v^T) - gy . y), the row dot product with the dropped output as without it."""
        (lse, y, drop), (qs, kv) = saved, opened(qkv, t, h)
        (gy, dot), gq, got, got_req = K._against(g, y, t, h), np.zeros_like(qs), None, None
        for hop, src, kv in self._hops(np.ascontiguousarray(kv)):
            dkv = np.zeros(kv.shape, dtype=kv.dtype)   # this rank's part of src's key and value gradients
            for qi, ki, s, keep in self._tiles(qs, kv, src, t, drop):
                tile_back(s, keep, qi, ki, qs, kv, lse, gy, dot, gq, dkv[:, :, :, ki])
            if got_req is not None:     # the gradients of src's keys and values so far, from the ranks before
                self._wait(*got_req, dkv.nbytes, "key and value gradients", hop)
                dkv += got
            got, got_req = self._shift(dkv, self.k + hop)
        self._wait(*got_req, got.nbytes, "key and value gradients", self.k)   # this rank's own, home
        return {0: qkv_grad(gq, got.transpose(1, 3, 0, 2, 4), qkv, g)}


class Chunks:
    """The run's data with this cp rank's part of each sequence: the data-parallel rank and size
    asked of it are the dp x cp group's (capstone.parallel.grid), k consecutive ranks reading the
    same sequences (the run's Batches: capstone.roles)."""

    def __init__(self, data, ring: Ring):
        self.data, self.ring, self.k = data, ring, ring.k

    def micro_batch(self, cursor: int, micro: int, rank: int, world: int):
        return tuple(map(self.ring.part, self.data.micro_batch(cursor, micro, rank // self.k, world // self.k)))

    def val_batch(self, k: int, count: int, rank: int = 0, world: int = 1):
        return tuple(map(self.ring.part, self.data.val_batch(k, count, rank // self.k, max(1, world // self.k))))
