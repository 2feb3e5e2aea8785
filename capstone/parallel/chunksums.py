"""--deterministic's norms and fingerprint of the canonical vector, from any layout's parts.

The canonical vector is the 1-rank model's flat vector (unpadded; capstone.parallel.tensor.positions
maps a part's elements to it). It is cut into fixed chunks of FIXED_CHUNK values; chunk c belongs to
world rank c % world. Each rank sends every value it holds once (its ZeRO shard of its part; a whole
parameter replicated over the tensor-parallel ranks from tp rank 0 only) to its chunk's owner: one
Alltoall (of blocks padded to the largest), whose plan (counts and the receivers' placement) is made once, at the
start. The owner has
each of its chunks whole and in order, and gives its float64 sum of squares (`sumsq`) and sha256; one
allgather of those, and every rank adds the sums in the fixed tree over chunk indices and hashes the
digests in chunk order (on the steps that are not evaluated, as capstone.model.fingerprint's weak digest: the
vector's 64-bit words summed modulo 2**64, each chunk's sum by its owner). So param_norm, the gradient norm and
the fingerprint are one quantity on every stage, tp, pp, cp and ZeRO layout, and no rank holds more than its
chunks (the whole model never does).
"""

import hashlib
import math

import numpy as np

from capstone.model.fingerprint import word_sum
from capstone.model import precision
from capstone.parallel.deterministic import FIXED_CHUNK, sumsq, tree_sum
from capstone.parallel.grid import allgathered


def whole(vector: np.ndarray) -> tuple[float, str]:
    """(sum of squares, sha256 fingerprint) of a whole canonical vector on one process: what `ChunkSums` gives from
    parts (the checkpoint tool prints it for a checkpoint's stored parameters)."""
    chunks = [vector[c:c + FIXED_CHUNK] for c in range(0, len(vector), FIXED_CHUNK)]
    return tree_sum(sumsq(c) for c in chunks), hashlib.sha256(b"".join(
        hashlib.sha256(c.tobytes()).digest() for c in chunks)).hexdigest()[:16]


class ChunkSums:
    """The canonical chunks' sums of squares and digests of the values this rank holds (see the module):
    `idx` their canonical indices (-1: a value another rank counts), of `n` in all."""

    def __init__(self, world, idx: np.ndarray, n: int):
        self.world, w, me = world, world.size, world.rank
        held = np.flatnonzero(idx >= 0)
        owner = (idx[held] // FIXED_CHUNK) % w
        take, counts = held[np.lexsort((idx[held], owner))], np.bincount(owner, minlength=w).astype(np.int64)
        # every[r, o]: values rank r sends to chunk owner o
        every = allgathered(world, counts, "deterministic norms: counts of the canonical chunks' values", "chunk_sums")
        self.block = int(every.max())                        # one Alltoall of equal blocks, padded to the largest
        self.src = np.zeros(w * self.block, dtype=np.int64)  # send position -> value (padding: any, never read)
        self.src[np.concatenate([o * self.block + np.arange(c, dtype=np.int64) for o, c in enumerate(counts)])] = take
        recv_at = np.concatenate([r * self.block + np.arange(c) for r, c in enumerate(every[:, me])]).astype(np.int64)
        where = self._exchange(idx.astype(np.int64), "deterministic norms: the canonical chunks' indices")[recv_at]
        self.n_chunks = -(-n // FIXED_CHUNK)
        self.per_rank, mine = -(-self.n_chunks // w), np.arange(me, self.n_chunks, w)   # this rank's chunks
        self.starts = np.concatenate(([0], np.cumsum(np.minimum(n, (mine + 1) * FIXED_CHUNK) - mine * FIXED_CHUNK)))
        base = np.zeros(self.n_chunks, dtype=np.int64)
        base[mine] = self.starts[:-1]
        place = base[where // FIXED_CHUNK] + where % FIXED_CHUNK
        if not (np.bincount(place, minlength=int(self.starts[-1])) == 1).all():   # each position exactly once
            raise RuntimeError("deterministic norms: the parts do not cover the canonical vector once")
        self.gather = np.empty(len(place), dtype=np.int64)   # this rank's chunks, in order <- received position
        self.gather[place] = recv_at

    def _exchange(self, values: np.ndarray, what: str) -> np.ndarray:
        """Collective: `values` to their chunks' owners (one gather, one Alltoall); what this rank received."""
        send = values[self.src] if len(values) else np.zeros(len(self.src), dtype=values.dtype)
        got = np.empty_like(send)
        self.world.Alltoall(send, got, what, "chunk_sums")
        return got

    def __call__(self, values: np.ndarray, digest: str | None = None) -> tuple[float, str | None]:
        """Collective over the world: (sum of squares of the canonical vector, its fingerprint: "sha256" of the chunks'
        sha256s, or "words": its 64-bit words summed modulo 2**64, as capstone.model.fingerprint's weak one; None)."""
        whole = self._exchange(values, "deterministic norms: the canonical chunks' values")[self.gather]
        mine = np.zeros((self.per_rank, 5))                  # per chunk: its sum of squares, its digest as 4 words
        for i, (a, b) in enumerate(zip(self.starts[:-1], self.starts[1:])):
            mine[i, 0] = sumsq(whole[a:b])
            if digest == "sha256":
                mine[i, 1:].view(np.uint8)[:] = np.frombuffer(hashlib.sha256(whole[a:b].tobytes()).digest(), np.uint8)
            elif digest:
                mine[i, 1:2].view(np.uint64)[0] = word_sum(whole[a:b])   # chunks of even length: the same words
        every = allgathered(self.world, mine, "allgather of the canonical chunks' sums", "allgather_stats")
        rows = [every[c % self.world.size, c // self.world.size] for c in range(self.n_chunks)]
        total = tree_sum(r[0] for r in rows)
        if digest == "sha256":
            return total, hashlib.sha256(b"".join(r[1:].tobytes() for r in rows)).hexdigest()[:16]
        words = sum(int(r[1:2].view(np.uint64)[0]) for r in rows) % (1 << 64)
        return total, None if digest is None else f"{words:016x}"


class CanonicalCheck:
    """Invariant (b) by `inner`'s check (capstone.parallel.replicas, zero3's); the step's param_norm and fingerprint
    are the canonical vector's, from `shard` of the parameters (ZeRO-3: all of them, the shard)."""

    def __init__(self, inner, sums: ChunkSums, shard: slice):
        self.inner, self.sums, self.shard = inner, sums, shard

    checked = property(lambda self: self.inner.checked)
    mismatches = property(lambda self: self.inner.mismatches)

    def check(self, step: int, params: np.ndarray, strong: bool) -> tuple[float, str]:
        self.inner.check(step, params, strong)
        sq, digest = self.sums(precision.values(params[self.shard]), digest="sha256" if strong else "words")
        return math.sqrt(sq), digest


def canonical_index(grid, cfg, layout, groups) -> np.ndarray:
    """Per element of this rank's ZeRO shard of its part: its index in the canonical vector, -1 for the padding and
    for a whole parameter on a tensor-parallel rank > 0 (tp rank 0 counts it)."""
    from capstone.parallel import tensor
    idx = np.full(layout.padded, -1, dtype=np.int64)
    at, owned = tensor.positions(cfg, grid.tp.size, grid.tp.rank, groups)   # 1 rank: 0, 1, 2, ..., all owned
    idx[:layout.n_params] = np.where(owned, at, -1)
    return idx[slice(*layout.shard_range(grid.dp.rank))]
