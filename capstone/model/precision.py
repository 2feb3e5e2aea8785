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

BF16 = np.uint16       # the bits of a bfloat16
CHUNK = 1 << 16        # values per pass of a narrowing: its temporaries stay in cache


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
        nan = np.isnan(x.reshape(-1)[lo:lo + CHUNK])
        if nan.any():              # a NaN stays a NaN: its upper half, made quiet
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
    big = isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim >= 2 and a.shape[-1] > 1
    big = big and a.flags.writeable
    return Stored(narrow(a)) if big else a


class Precision:
    """--precision fp32: the working parameters are the float32 values, nothing is narrowed."""

    name, dtype, itemsize = "fp32", np.float32, 4

    def keep(self, saved):
        """What a layer keeps for its backward pass."""
        return saved

    def unkept(self, saved):
        """The kept activations back as float32 (a bf16 list is emptied: its arrays are freed as used)."""
        return saved

    def publish(self, master: np.ndarray, out: np.ndarray) -> None:
        """The working parameters `out` from the float32 `master`."""
        np.copyto(out, master)

    def working(self, params: np.ndarray) -> np.ndarray:
        """The working buffer of the initial float32 `params` (itself)."""
        return params


class Bf16(Precision):
    """--precision bf16 (see the module)."""

    name, dtype, itemsize = "bf16", BF16, 2

    def keep(self, saved):
        return _map(_narrowed, saved)

    def unkept(self, saved):
        out = _map(lambda s: widen(s.bits) if isinstance(s, Stored) else s, saved)
        saved.clear()
        return out

    def publish(self, master: np.ndarray, out: np.ndarray) -> None:
        narrow(master, out)

    def working(self, params: np.ndarray) -> np.ndarray:
        return narrow(params)


FP32, BF16_RUN = Precision(), Bf16()


def of(name: str) -> Precision:
    """The precision of --precision `name`."""
    return BF16_RUN if name == "bf16" else FP32
