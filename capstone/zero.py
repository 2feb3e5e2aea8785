"""ZeRO-1: Adam whose fp32 master copy and moments are sharded across ranks.

The flat gradient buffer is reduce-scattered so each rank receives the summed gradient of its
shard; Adam updates the rank's shard of (master, m, v); the updated shard is allgathered into
the flat parameter buffer in place. Per-rank optimizer memory is 12 * padded / world bytes.
This module (with checkpoint.py and dist.py) is the only one that calls MPI collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .params import DTYPE, Layout


@dataclass(frozen=True)
class GradStats:
    """Global facts about one step's reduced gradient (identical on every rank)."""

    norm: float          # L2 norm of the full (unsharded) reduced gradient
    finite: bool         # every gradient entry and every `extras` value is finite
    extras: np.ndarray   # the caller's per-rank values, summed over ranks (float64)


class ZeroAdam:
    """Adam(W) with ZeRO-1 sharding over `comm`; `params` and `grads` are flat buffers of `layout`."""

    def __init__(self, comm, layout: Layout, params: np.ndarray, grads: np.ndarray,
                 betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
        """Collective: call on all ranks. Broadcasts rank 0's parameters (DDP-style, once)."""
        if layout.world != comm.Get_size():
            raise ValueError(f"layout is padded for {layout.world} ranks but the communicator has {comm.Get_size()}")
        for name, buf in (("params", params), ("grads", grads)):
            if buf.dtype != DTYPE or buf.shape != (layout.padded,) or not buf.flags.c_contiguous:
                raise ValueError(f"{name} must be a contiguous float32 buffer of length {layout.padded}")
        self.comm, self.layout, self.params, self.grads = comm, layout, params, grads
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        self.lo, self.hi = layout.shard_range(self.rank)
        self.beta1, self.beta2, self.eps, self.weight_decay = float(betas[0]), float(betas[1]), float(eps), float(weight_decay)
        comm.Bcast(params, root=0)
        self.master = params[self.lo:self.hi].copy()
        self.m = np.zeros_like(self.master)
        self.v = np.zeros_like(self.master)
        self.t = 0
        self.g_shard = np.empty_like(self.master)
        self.counts = [layout.shard] * self.world
        self.decay_mask = self._decay_mask() if weight_decay > 0 else None
        self.timings = {"reduce_scatter": 0.0, "adam": 0.0, "allgather": 0.0}  # seconds, last step

    def _decay_mask(self) -> np.ndarray:
        """1.0 where weight decay applies (matrices and embeddings), 0.0 for biases and LayerNorm."""
        full = np.zeros(self.layout.padded, dtype=DTYPE)
        for _, shape, off in self.layout.entries:
            if len(shape) >= 2:
                full[off:off + int(np.prod(shape))] = 1.0
        return full[self.lo:self.hi].copy()

    def optimizer_nbytes(self) -> int:
        """Bytes of optimizer state held by this rank: fp32 master + Adam m + Adam v."""
        return self.master.nbytes + self.m.nbytes + self.v.nbytes

    def reduce_gradients(self, extras=()) -> GradStats:
        """Collective: call on all ranks. Reduce-scatter (sum) the flat gradient into this rank's
        shard, then one small Allreduce of [shard sum of squares, *extras] for the global norm,
        the non-finite check and the caller's scalars (e.g. the loss sum)."""
        t0 = time.perf_counter()
        # Plain Reduce_scatter with equal counts: Open MPI 4.1's Reduce_scatter_block algorithm is
        # 2.5-4x slower at 1M+ floats here (scripts/bench prints both).
        self.comm.Reduce_scatter(self.grads, self.g_shard, self.counts, op=MPI.SUM)
        self.timings["reduce_scatter"] = time.perf_counter() - t0
        g64 = self.g_shard.astype(np.float64)
        small = np.array([np.dot(g64, g64), *extras], dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, small, op=MPI.SUM)
        return GradStats(float(np.sqrt(small[0])), bool(np.all(np.isfinite(small))), small[1:])

    def apply(self, lr: float, grad_scale: float = 1.0) -> None:
        """Collective: call on all ranks after `reduce_gradients`. Adam on the local shard with the
        gradient multiplied by `grad_scale` (clipping), then Allgather the shard into `params`."""
        t0 = time.perf_counter()
        g = self.g_shard
        if grad_scale != 1.0:
            g *= np.float32(grad_scale)
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        self.m *= np.float32(b1)
        self.m += np.float32(1 - b1) * g
        self.v *= np.float32(b2)
        self.v += np.float32(1 - b2) * (g * g)
        denom = np.sqrt(self.v)
        denom *= np.float32(1.0 / np.sqrt(1 - b2 ** self.t))
        denom += np.float32(self.eps)
        if self.decay_mask is not None:
            self.master -= np.float32(lr * self.weight_decay) * self.decay_mask * self.master
        self.master -= np.float32(lr / (1 - b1 ** self.t)) * (self.m / denom)
        self.timings["adam"] = time.perf_counter() - t0
        self._publish()

    def step(self, lr: float) -> GradStats:
        """Collective: call on all ranks. The whole optimizer.step(): reduce-scatter, Adam, allgather."""
        stats = self.reduce_gradients()
        self.apply(lr)
        return stats

    def _publish(self) -> None:
        """Collective: call on all ranks. Copy the master shard into params and allgather it."""
        t0 = time.perf_counter()
        self.params[self.lo:self.hi] = self.master
        self.comm.Allgather(MPI.IN_PLACE, self.params)
        self.timings["allgather"] = time.perf_counter() - t0

    def state_finite(self) -> bool:
        """Whether this rank's master, m and v are all finite (after an update they may not be)."""
        return bool(np.isfinite(self.master).all() and np.isfinite(self.m).all() and np.isfinite(self.v).all())

    def state(self) -> dict:
        """This rank's optimizer state: arrays are the live shards (copy them to snapshot)."""
        return {"master": self.master, "m": self.m, "v": self.v, "t": self.t}

    def load_state(self, master: np.ndarray, m: np.ndarray, v: np.ndarray, t: int) -> None:
        """Collective: call on all ranks. Replace the local shard state and rebuild `params`."""
        for name, dst, src in (("master", self.master, master), ("m", self.m, m), ("v", self.v, v)):
            if src.shape != dst.shape:
                raise ValueError(f"{name} shard has shape {src.shape}, this rank needs {dst.shape}")
            dst[...] = src
        self.t = int(t)
        self._publish()
