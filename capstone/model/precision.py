"""The run's precision (--precision): float32 throughout, or bfloat16 working copies over a float32 master.

With bf16 the parameters the layers read, the activations a layer keeps for its backward pass and the messages of
the data-parallel exchanges are bfloat16; the arithmetic, the gradient buffer, the sums and the optimizer's master,
m and v stay float32 (docs/precision.md). A bfloat16 is the upper half of a float32's bits, held in a uint16 array
(MPI moves it as 16-bit words; nothing adds it as integers). Widening is a 16-bit shift, exact. Narrowing rounds the
lower half to nearest even with NumPy's integer operations, not ml_dtypes' cast: no dependency, the same bits with
every NumPy, and a NaN kept a NaN on purpose (the rounding's carry would turn a NaN whose payload lies in the lower
half into an infinity, which the guard would then miss).
"""

import numpy as np

from capstone.model.seam import Resident

BF16 = np.uint16       # the bits of a bfloat16
CHUNK = 1 << 18        # values per pass of a narrowing: its temporaries stay in cache (1 MiB)


def narrow(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The bfloat16 bits of float32 `x` (into the contiguous uint16 `out`), rounded to nearest, ties to even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=BF16) if out is None else out
    u, o = x.reshape(-1).view(np.uint32), out.reshape(-1)
    lower = np.empty(min(CHUNK, u.size), dtype=np.uint32)
    for lo in range(0, u.size, CHUNK):
        a, t = u[lo:lo + CHUNK], lower[:min(CHUNK, u.size - lo)]
        np.right_shift(a, 16, out=t)
        t &= 1                     # ties to even: half an ulp less one, plus the kept half's last bit
        t += 0x7FFF
        t += a
        np.right_shift(t, 16, out=o[lo:lo + CHUNK], casting="unsafe")
        if np.isnan(np.min(x.reshape(-1)[lo:lo + CHUNK])):      # a NaN stays a NaN: its upper half, made quiet
            nan = np.isnan(x.reshape(-1)[lo:lo + CHUNK])
            o[lo:lo + CHUNK][nan] = (a[nan] >> 16) | 0x40
    return out


def widen(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 values of bfloat16 `bits` (exact), into `out` (a new array if None)."""
    out = np.empty(bits.shape, dtype=np.float32) if out is None else out
    np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32, casting="unsafe")
    return out


def values(a: np.ndarray) -> np.ndarray:
    """A buffer's values as float32 (a bfloat16 buffer widened; a float32 one as it is)."""
    return widen(a) if a.dtype == BF16 else a


class Stored:
    """An activation kept for the backward pass as bfloat16."""

    __slots__ = ("bits",)

    def __init__(self, bits: np.ndarray):
        self.bits = bits


def _map(f, saved):
    return type(saved)(_map(f, s) for s in saved) if isinstance(saved, (list, tuple)) else f(saved)


def _narrowed(a):
    """Activations (float32 arrays of at least 2 axes, rows longer than 1, that the pass made: dropout's masks are
    read-only) narrowed; the rest as it is."""
    big = isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim >= 2 and a.shape[-1] > 1 and a.flags.writeable
    return Stored(narrow(a)) if big else a


class Bf16:
    """--precision bf16's transformation of the model (see the module); --precision fp32 has none (None)."""

    def keep(self, saved):
        """What a layer keeps for its backward pass, its activations narrowed."""
        return _map(_narrowed, saved)

    def unkept(self, saved):
        """The kept activations back as float32; `saved` is emptied (its arrays freed as they are used)."""
        out = _map(lambda s: widen(s.bits) if isinstance(s, Stored) else s, saved)
        saved.clear()
        return out

    def cast(self, out: np.ndarray, master: np.ndarray) -> None:
        """The working parameters `out` from the float32 `master`, rounded (np.copyto's order: fp32's cast)."""
        narrow(master, out)

    working = staticmethod(narrow)      # the working buffer of the initial float32 parameters


class Widened(Resident):
    """The seam of resident bfloat16 working weights (capstone.model.seam.Resident): a layer reads its group
    widened to float32, a copy it drops when done."""

    def weights(self, group: str, backward: bool = False) -> np.ndarray:
        return widen(self.groups[group])

    def whole(self) -> np.ndarray:
        return widen(self.params)


def of(name: str) -> Bf16 | None:
    """The transformation of --precision `name` (None: fp32, none)."""
    return Bf16() if name == "bf16" else None
