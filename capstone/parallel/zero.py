"""ZeRO-1: AdamW whose fp32 master copy and moments are sharded over the data-parallel group.

How it works: docs/design.md, "Inside the step", parallel/zero.py."""

import numpy as np

from capstone.model.params import DTYPE, Layout, no_decay_runs
from capstone.step.state import ROWS, ShardState

ADAM_CHUNK = 1 << 16         # elements per pass of the update: the arrays of one pass stay in L2 (256 KiB each)


class ZeroAdam:
    """Adam(W) with ZeRO-1 sharding over `dp` (a Comm): this rank updates shard [lo, hi) of the flat `params`."""

    def __init__(self, dp, layout: Layout, params: np.ndarray, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                 clip: float = 0.0, undo: bool = True, replicate: bool = False, prec=None, working=None):
        """Collective: call on all ranks of `dp`. Broadcasts its rank 0's parameters (DDP-style, once). `working`:
        the buffer the layers read (`prec`, --precision bf16's capstone.model.precision.Bf16: bfloat16 made from the
        master after each update; None: `params` itself)."""
        if layout.world != dp.size:
            raise ValueError(f"layout is padded for {layout.world} ranks but the data-parallel group has {dp.size}")
        self.dp, self.layout, self.params = dp, layout, params
        self.lo, self.hi = (0, layout.padded) if replicate else layout.shard_range(dp.rank)
        self.beta1, self.beta2, self.eps = float(betas[0]), float(betas[1]), float(eps)
        self.weight_decay, self.clip = float(weight_decay), float(clip)   # clip: of the global gradient norm (0: off)
        master = self._adopt(params)
        self.params, self.cast = params if working is None else working, np.copyto if prec is None else prec.cast
        if working is not None:
            self.cast(working, params)
        self.state = ShardState(master, np.zeros_like(master), np.zeros_like(master))
        # before: the state before the last apply; revertible: `before` may be restored
        self.before, self.revertible = ShardState(*(np.zeros_like(master) for _ in ROWS)) if undo else None, False
        self.no_decay = no_decay_runs(layout, self.lo, self.hi, ADAM_CHUNK) if weight_decay > 0 else None
        self._scratch = np.empty((2, ADAM_CHUNK), dtype=np.float32)

    def _adopt(self, params: np.ndarray) -> np.ndarray:
        """Check `params`, make it the same on every rank and return a copy of this rank's shard."""
        if params.dtype != DTYPE or params.shape != (self.layout.padded,) or not params.flags.c_contiguous:
            raise ValueError(f"params must be a contiguous float32 buffer of length {self.layout.padded}")
        self.dp.Bcast(params, "broadcast of the initial parameters")
        return params[self.lo:self.hi].copy()

    def before_nbytes(self) -> int:
        """Bytes of the state kept from before the last update (what `revert` restores; 0: no undo)."""
        return 0 if self.before is None else self.before.nbytes

    def apply(self, grad_shard: np.ndarray, lr: float, norm: float) -> float:
        """Collective: call on all ranks. Adam on the local shard with the reduced gradient shard (scaled by
        clip / norm when the whole gradient's `norm` exceeds `clip`), then allgather the shard into `params`;
        returns the norm after clipping."""
        # no `before`: in place
        clip, old, new = self.clip if 0 < self.clip < norm else 0.0, self.state, self.before or self.state
        self.update(grad_shard, lr, clip / norm if clip else 1.0, old, new)
        self.state, self.before, self.revertible = new, old if self.before else None, self.before is not None
        self._publish()
        return clip or norm

    def update(self, grad_shard: np.ndarray, lr: float, grad_scale: float, old: ShardState, new: ShardState) -> None:
        """AdamW of step old.t + 1 from `old` into `new` (may be `old`), the gradient scaled by `grad_scale`,
        a cache-sized chunk at a time through the scratch rows (the whole-array expressions' bits)."""
        new.t, b1, b2 = old.t + 1, self.beta1, self.beta2
        scale, b1, one_b1, b2, one_b2, bias2, eps, decay, step = map(np.float32, (
            grad_scale, b1, 1 - b1, b2, 1 - b2, 1.0 / np.sqrt(1 - b2 ** new.t), self.eps, lr * self.weight_decay,
            lr / (1 - b1 ** new.t)))
        for lo in range(0, old.master.size, ADAM_CHUNK):
            c = slice(lo, lo + ADAM_CHUNK)
            g, m, v, master = grad_shard[c], new.m[c], new.v[c], new.master[c]
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
                for z in self.no_decay[lo // ADAM_CHUNK]:
                    t2[z] = 0.0
                np.subtract(src, t2, out=master)
                src = master
            np.divide(m, t1, out=t2)                       # master -= lr / (1 - b1^t) * m / denom
            t2 *= step
            np.subtract(src, t2, out=master)

    def revert(self) -> None:
        """Collective: call on all ranks. Undo the last `apply` bit for bit (once: a second call keeps that state)."""
        if self.revertible:
            self.state, self.before, self.revertible = self.before, self.state, False
        self._publish()

    def finite(self) -> bool:
        return self.state.finite()   # no NaN or infinity in this rank's master, m or v

    def _publish(self) -> None:
        """Collective: call on all ranks. Copy the master shard into params (bf16: rounded) and allgather it."""
        self.cast(self.params[self.lo:self.hi], self.state.master)
        self.dp.Allgather(self.params, "allgather of the updated parameters", "allgather")

    def load_state(self, state: ShardState) -> None:
        """Collective: call on all ranks. Replace the local shard state and rebuild `params`."""
        self.state.copy_from(state)
        self.revertible = False
        self._publish()
