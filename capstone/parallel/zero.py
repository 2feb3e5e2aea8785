"""ZeRO-1: Adam whose fp32 master copy and moments are sharded across ranks.

The flat gradient buffer is reduce-scattered so each rank receives the summed gradient of its
shard; Adam updates the rank's shard of (master, m, v); the updated shard is allgathered into
the flat parameter buffer in place. Per-rank optimizer memory is 12 * padded / world bytes.
This module (with checkpoint.py and dist.py) is the only one that calls MPI collectives.

Every collective is non-blocking and waited on with a deadline (capstone.deadline), so a dead peer
ends the job instead of hanging it. With `bucket_floats` the reduce-scatter runs in buckets that
start during the backward pass (capstone.buckets); without, it is one reduce-scatter of the whole
buffer after the backward pass (--no-overlap).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from capstone.parallel.buckets import BucketedReduceScatter
from capstone.parallel.deadline import Deadline
from capstone.model.params import DTYPE, Layout, sum_squares

ROWS = ("master", "m", "v")  # the arrays of a shard's optimizer state, in checkpoint row order
ADAM_CHUNK = 1 << 16         # elements per pass of the update: the arrays of one pass stay in L2 (256 KiB each)


_ZEROS = np.zeros(1024, dtype=DTYPE)


def _finite(a: np.ndarray) -> bool:
    """Whether every value of a is finite, in one BLAS pass: rows of 1024 values times a zero
    vector give 0 * x = NaN for an infinite or NaN x and 0 otherwise (3x faster than isfinite)."""
    full = a.size - a.size % _ZEROS.size
    with np.errstate(invalid="ignore"):
        rows = np.dot(a[:full].reshape(-1, _ZEROS.size), _ZEROS)
    return bool(np.isfinite(rows).all() and np.isfinite(a[full:]).all())


@dataclass
class ShardState:
    """One rank's ZeRO-1 optimizer state: fp32 master copy, Adam m and v of its shard; Adam step t."""

    master: np.ndarray
    m: np.ndarray
    v: np.ndarray
    t: int = 0

    def rows(self) -> list[np.ndarray]:
        return [getattr(self, r) for r in ROWS]

    def copy_from(self, other: "ShardState") -> None:
        for r in ROWS:
            src, dst = getattr(other, r), getattr(self, r)
            if src.shape != dst.shape:
                raise ValueError(f"{r} shard has shape {src.shape}, this rank needs {dst.shape}")
            dst[...] = src
        self.t = int(other.t)

    def finite(self) -> bool:
        """No NaN or infinity in master, m or v."""
        return all(_finite(a) for a in self.rows())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.rows())


@dataclass(frozen=True)
class GradStats:
    """Global facts about one step's reduced gradient (identical on every rank)."""

    norm: float          # L2 norm of the full (unsharded) reduced gradient
    extras: np.ndarray   # the caller's per-rank values, summed over ranks (float64)


class ZeroAdam:
    """Adam(W) with ZeRO-1 sharding over `comm`; `params` and `grads` are flat buffers of `layout`."""

    def __init__(self, comm, layout: Layout, params: np.ndarray, grads: np.ndarray,
                 betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, deadline: Deadline | None = None,
                 bucket_floats: int = 0):
        """Collective: call on all ranks. Broadcasts rank 0's parameters (DDP-style, once).
        `deadline`: the timeout of the collectives (default: automatic); `bucket_floats` > 0:
        reduce-scatter in buckets of about that many floats, overlapped with backward."""
        if layout.world != comm.Get_size():
            raise ValueError(f"layout is padded for {layout.world} ranks but the communicator has {comm.Get_size()}")
        for name, buf in (("params", params), ("grads", grads)):
            if buf.dtype != DTYPE or buf.shape != (layout.padded,) or not buf.flags.c_contiguous:
                raise ValueError(f"{name} must be a contiguous float32 buffer of length {layout.padded}")
        self.comm, self.layout, self.params, self.grads = comm, layout, params, grads
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.lo, self.hi = layout.shard_range(self.rank)
        self.beta1, self.beta2, self.eps, self.weight_decay = float(betas[0]), float(betas[1]), float(eps), float(weight_decay)
        self.deadline = deadline if deadline is not None else Deadline(comm)
        self.deadline.wait(comm.Ibcast(params, root=0), "broadcast of the initial parameters")
        master = params[self.lo:self.hi].copy()
        self.state = ShardState(master, np.zeros_like(master), np.zeros_like(master))
        self.before = ShardState(*(np.zeros_like(master) for _ in ROWS))  # the state before the last apply
        self.revertible = False                                            # `before` may be restored
        self.g_shard = np.empty_like(master)
        self.overlap = bucket_floats > 0
        self.reducer = BucketedReduceScatter(comm, layout, grads, self.g_shard, self.deadline,
                                             bucket_floats if self.overlap else layout.padded)
        self.no_decay = self._no_decay_runs() if weight_decay > 0 else None
        self._scratch = np.empty((2, ADAM_CHUNK), dtype=np.float32)
        self.timings = {"reduce_scatter": 0.0, "adam": 0.0, "allgather": 0.0}  # seconds, last step

    def _no_decay_runs(self) -> list[list[slice]]:
        """Per Adam pass (ADAM_CHUNK elements of the shard), the slices of the pass that take no weight
        decay: biases, LayerNorm and padding; matrices and embeddings decay. A few slices per layer,
        where a mask would cost a byte per element and a pass over it."""
        decays = np.zeros(self.hi - self.lo + 2, dtype=np.int8)   # 1 where decay applies, 0-padded ends
        for _, shape, off in self.layout.entries:
            a, b = max(off, self.lo), min(off + int(np.prod(shape)), self.hi)
            if len(shape) >= 2 and a < b:
                decays[1 + a - self.lo:1 + b - self.lo] = 1
        edges = np.flatnonzero(np.diff(decays)).reshape(-1, 2)    # [start, end) of each decaying run
        starts = np.concatenate(([0], edges[:, 1]))
        ends = np.concatenate((edges[:, 0], [self.hi - self.lo]))
        runs = []
        for lo in range(0, self.hi - self.lo, ADAM_CHUNK):
            hi = min(lo + ADAM_CHUNK, self.hi - self.lo)
            runs.append([slice(max(a, lo) - lo, min(b, hi) - lo) for a, b in zip(starts.tolist(), ends.tolist())
                         if max(a, lo) < min(b, hi)])
        return runs

    def optimizer_nbytes(self) -> int:
        """Bytes of optimizer state held by this rank: fp32 master + Adam m + Adam v."""
        return self.state.nbytes

    def before_nbytes(self) -> int:
        """Bytes of the state kept from before the last update (what `revert` restores)."""
        return self.before.nbytes

    def begin_step(self, step: int, micro_batches: int) -> None:
        """Before step `step`'s forward+backward (of `micro_batches` micro-batches): name the step
        in timeout messages, measure step times for the automatic timeout, and (with buckets) let
        the backward pass start the reduce-scatter of each bucket as soon as it is ready."""
        self.deadline.begin_step(step)
        if self.overlap:
            self.reducer.arm(micro_batches)

    def reduce_gradients(self, extras=()) -> GradStats:
        """Collective: call on all ranks. Reduce-scatter (sum) the flat gradient into this rank's
        shard, then one small Allreduce of [shard sum of squares, *extras] for the global norm,
        the non-finite check and the caller's scalars (e.g. the loss sum). With buckets, the
        buckets the backward pass started are waited for and the rest started first."""
        t0 = time.perf_counter()
        self.reducer.finish()   # one bucket without overlap: a single reduce-scatter (capstone.buckets)
        self.timings["reduce_scatter"] = time.perf_counter() - t0
        small = np.array([sum_squares(self.g_shard), *extras], dtype=np.float64)
        self.deadline.wait(self.comm.Iallreduce(MPI.IN_PLACE, small, op=MPI.SUM),
                           "allreduce of the gradient norm and loss")
        return GradStats(float(np.sqrt(small[0])), small[1:])

    def apply(self, lr: float, grad_scale: float = 1.0) -> None:
        """Collective: call on all ranks after `reduce_gradients`. Adam on the local shard with the
        gradient multiplied by `grad_scale` (clipping), then Allgather the shard into `params`.
        The update reads `state` and writes the spare arrays, which then become `state`: the state
        before it stays intact in `before` for `revert`, without a copy."""
        t0 = time.perf_counter()
        old, new = self.state, self.before
        new.t = old.t + 1
        b1, b2 = self.beta1, self.beta2
        k = (np.float32(grad_scale), np.float32(b1), np.float32(1 - b1), np.float32(b2), np.float32(1 - b2),
             np.float32(1.0 / np.sqrt(1 - b2 ** new.t)), np.float32(self.eps), np.float32(lr * self.weight_decay),
             np.float32(lr / (1 - b1 ** new.t)))
        for lo in range(0, old.master.size, ADAM_CHUNK):
            self._adam_chunk(slice(lo, lo + ADAM_CHUNK), old, new, *k)
        self.state, self.before, self.revertible = new, old, True
        self.timings["adam"] = time.perf_counter() - t0
        self._publish()

    def revert(self) -> None:
        """Collective: call on all ranks. Undo the last `apply` bit for bit: its `before` state
        becomes the state again and is republished. Once only: a second call keeps that state."""
        if self.revertible:
            self.state, self.before, self.revertible = self.before, self.state, False
        self._publish()

    def _adam_chunk(self, c: slice, old: ShardState, new: ShardState,
                    scale, b1, one_b1, b2, one_b2, bias2, eps, decay, step) -> None:
        """AdamW on elements c of the shard from `old` into `new`, through cache-sized scratch
        buffers. The operations per element are those of the whole-array expressions (the same bits)."""
        g, m, v, master = self.g_shard[c], new.m[c], new.v[c], new.master[c]
        t1, t2 = self._scratch[0][:g.size], self._scratch[1][:g.size]
        if scale != 1.0:
            g *= scale
        np.multiply(old.m[c], b1, out=m)               # m = b1 m + (1 - b1) g
        np.multiply(g, one_b1, out=t1)
        m += t1
        np.multiply(old.v[c], b2, out=v)               # v = b2 v + (1 - b2) g^2
        np.multiply(g, g, out=t1)
        t1 *= one_b2
        v += t1
        np.sqrt(v, out=t1)                             # denom = sqrt(v) / sqrt(1 - b2^t) + eps
        t1 *= bias2
        t1 += eps
        src = old.master[c]
        if self.no_decay is not None:                  # decoupled weight decay, not on biases and LayerNorm
            np.multiply(src, decay, out=t2)
            for z in self.no_decay[c.start // ADAM_CHUNK]:
                t2[z] = 0.0
            np.subtract(src, t2, out=master)
            src = master
        np.divide(m, t1, out=t2)                       # master -= lr / (1 - b1^t) * m / denom
        t2 *= step
        np.subtract(src, t2, out=master)

    def _publish(self) -> None:
        """Collective: call on all ranks. Copy the master shard into params and allgather it."""
        t0 = time.perf_counter()
        self.params[self.lo:self.hi] = self.state.master
        self.deadline.wait(self.comm.Iallgather(MPI.IN_PLACE, self.params), "allgather of the updated parameters")
        self.timings["allgather"] = time.perf_counter() - t0

    def load_state(self, state: ShardState) -> None:
        """Collective: call on all ranks. Replace the local shard state and rebuild `params`."""
        self.state.copy_from(state)
        self.revertible = False
        self._publish()
