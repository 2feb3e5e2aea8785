"""--dropout P: GPT-2's dropout at its three sites, the same mask on every grid (imported only when P > 0).

The sites: the embedding's output, the attention probabilities, and each residual branch's output
(the attention's and the MLP's projections) before it is added. A kept value is scaled by 1/(1-P);
evaluation and sampling run without dropout. The mask is a pure function of (seed, step, the
sample's index in the step's global batch, layer, site, global position, and channel, or global head
and key position): a counter-based hash (SplitMix64's finaliser over those integers), not a random
stream, so every data-parallel layout, accumulation, tensor-parallel split (a rank's heads are named
by their global index), pipeline stage, recomputation and resume draws the same mask for the same
element as one rank does. The sample's index: micro-batch j on data-parallel replica r of R with
B rows holds the step's samples (j R + r) B ... (j R + r) B + B - 1, as capstone.data deals them
(under --cp the K ranks of a ring hold the same samples: r is the replica, not the dp x cp rank).
The position is the sequence's own: a context-parallel rank's rows sit at its two chunks' positions
and its ring attention (capstone.model.ring) masks each block at its global (query, key) positions,
the same mask as the whole (T, T) one of one rank (capstone.model.blocks.WHOLE, whose attention with
a mask is `attention_forward` here).

The masks are inputs of the one model's layers (capstone.model.backward's `Pass`): `Draws` makes each
micro-batch's, counting a step's micro-batches as their forwards begin.
"""

import functools
import math

import numpy as np

from capstone.model import kernels as K

M64 = (1 << 64) - 1
GOLD = 0x9E3779B97F4A7C15
SITES = ("embed", "attention", "attn_out", "mlp_out")   # a mask's site: its index in the hash


def mix(z: int) -> int:
    """SplitMix64's finaliser of a Python integer (mod 2^64): `mix_array`'s of one value."""
    return int(mix_array(np.array([z & M64], dtype=np.uint64))[0])


def mix_array(z: np.ndarray) -> np.ndarray:
    """`mix` over a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Masks:
    """The masks of one micro-batch: `samples` (B,) their indices in the step's global batch, `cp`
    where this rank's rows sit in the sequence (None: the whole sequence; a context-parallel `Ring`)."""

    def __init__(self, p: float, seed: int, step: int, samples: np.ndarray, cp=None):
        self.seed, self.step, self.samples, self.cp = seed, step, samples.astype(np.uint64), cp
        self.scale, self.threshold = np.float32(1.0 / (1.0 - p)), np.uint64(round(p * (1 << 24)))

    def keep(self, layer: int, site: str, inner: np.ndarray) -> np.ndarray:
        """(B, inner.size) float32: 0 or 1/(1-p) for element ids `inner` (uint64) of each sample."""
        key = mix(mix(mix(self.seed * GOLD + self.step) ^ (layer + 1) * GOLD) ^ SITES.index(site))
        base = mix_array(np.uint64(key) ^ (self.samples * np.uint64(GOLD)))
        h = mix_array(base[:, None] ^ inner[None, :])
        mask = np.where((h >> np.uint64(40)) >= self.threshold, self.scale, np.float32(0))
        mask.flags.writeable = False      # an input, kept as it is (--precision bf16 narrows only activations)
        return mask

    def channels(self, layer: int, site: str, t: int, C: int) -> np.ndarray:
        """(B*t, C): element (global position u of this rank's row, channel c) of each sample, id u C + c."""
        pos = None if self.cp is None else self.cp.positions(t)
        pos = np.arange(t, dtype=np.uint64) if pos is None else pos.astype(np.uint64)
        return self.keep(layer, site, (pos[:, None] * np.uint64(C) + np.arange(C, dtype=np.uint64)).reshape(-1)
                         ).reshape(-1, C)

    def attention(self, layer: int, T: int, H: int, first_head: int, q=None, k=None) -> np.ndarray:
        """(B, H, len q, len k): heads first_head ... (global), queries at positions q, keys at k (None:
        0..T-1) of a sequence of T: id (head T + query) T + key."""
        q, k = (np.arange(T, dtype=np.uint64) if a is None else np.asarray(a, dtype=np.uint64) for a in (q, k))
        heads = np.arange(first_head, first_head + H, dtype=np.uint64)
        ids = ((heads[:, None] * np.uint64(T) + q[None, :])[:, :, None] * np.uint64(T) + k[None, None, :])
        return self.keep(layer, "attention", ids.reshape(-1)).reshape(-1, H, q.size, k.size)

    def drop(self, layer: int, t: int, H: int, first_head: int):
        """The attention mask of this rank's t rows as a function of (query positions, key positions),
        which `cp`'s attention calls for the blocks it computes."""
        return functools.partial(self.attention, layer, t * (1 if self.cp is None else self.cp.k), H, first_head)


class Draws:
    """The run's dropout masks: those of each micro-batch of a step, in the order their forwards begin
    (every stage runs them in order). The model asks for them (capstone.model.gpt.Model: `begin`, `next`)."""

    def __init__(self, p: float, seed: int, replica: int, replicas: int, cp=None):
        self.p, self.seed, self.replica, self.replicas, self.cp = p, seed, replica, replicas, cp
        self.step_no, self.micro = 0, 0

    def begin(self, step: int) -> None:
        self.step_no, self.micro = step, 0

    def next(self, B: int) -> Masks:
        """The masks of the step's next micro-batch of B rows on this rank."""
        first = (self.micro * self.replicas + self.replica) * B
        self.micro += 1
        return Masks(self.p, self.seed, self.step_no, np.arange(first, first + B), self.cp)


def attention_forward(qkv, T, H, keep):
    """Causal attention with the probabilities dropped by `keep` (B, H, T, T): (B*T, 3C) -> (B*T, C)."""
    q, k, v = K._split_heads(qkv, T, H)
    B, _, _, D = q.shape
    s = K._mm(q, k.swapaxes(-1, -2)) * np.float32(1.0 / math.sqrt(D)) + K.causal_mask(T)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return np.ascontiguousarray(K._mm(p * keep, v).transpose(0, 2, 1, 3)).reshape(B * T, -1), (p, keep)


def attention_backward(g, saved, qkv, T, H):
    p, keep = saved
    q, k, v = K._split_heads(qkv, T, H)
    B, _, _, D = q.shape
    gy = K._heads(g, B, T, H)
    gqkv = np.empty((B, T, 3, H, D), dtype=np.result_type(qkv, g))
    gq, gk, gv = (gqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    gv[...] = K._mm((p * keep).swapaxes(-1, -2), gy)
    gp = K._mm(gy, v.swapaxes(-1, -2)) * keep
    gs = p * (gp - (gp * p).sum(axis=-1, keepdims=True))
    gq[...] = K._mm(gs, k) * np.float32(1.0 / math.sqrt(D))
    gk[...] = K._mm(gs.swapaxes(-1, -2), q) * np.float32(1.0 / math.sqrt(D))
    return gqkv.reshape(qkv.shape)
