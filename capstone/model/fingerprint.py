"""Numbers that summarise a flat float32 buffer: its sum of squares (norms, in float64 over chunks), and a
fingerprint (norm and digest) that replicas compare every step (invariant (b), docs/invariants.md)."""

import hashlib
import math

import numpy as np

NORM_CHUNK = 1 << 16   # float64 copies of this many values stay in cache (a whole-buffer copy is 15x slower)


def sum_squares(flat: np.ndarray, weight: np.ndarray | None = None) -> float:
    """Sum of (weight *) squares of a vector in float64, converted chunk by chunk."""
    total = 0.0
    for c in range(0, flat.size, NORM_CHUNK):
        x = flat[c:c + NORM_CHUNK]                                                           # bf16: widened
        x = ((x.astype(np.uint32) << 16).view(np.float32) if x.dtype == np.uint16 else x).astype(np.float64)
        total += float(np.dot(x if weight is None else x * weight[c:c + NORM_CHUNK], x))
    return total


def word_sum(flat: np.ndarray) -> int:
    """The buffer's bytes summed as 64-bit words modulo 2**64 (an odd last 32-bit word added on its own)."""
    u = np.ascontiguousarray(flat).reshape(-1).view(np.uint32)
    even = u.size - u.size % 2
    return (int(np.add.reduce(u[:even].view(np.uint64))) + int(u[even:].sum())) % (1 << 64)


def fingerprint(flat: np.ndarray, strong: bool = True) -> tuple[float, str]:
    """(L2 norm in float64, 16 hex digits) of a contiguous buffer: the sha256 prefix if `strong`, else the word sum."""
    norm = math.sqrt(sum_squares(flat))
    if not strong:
        return norm, f"{word_sum(flat):016x}"
    return norm, hashlib.sha256(memoryview(np.ascontiguousarray(flat)).cast("B")).hexdigest()[:16]
