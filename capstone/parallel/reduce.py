"""The gradient reduction: one interface, the modes' implementations
(docs/design.md, "Inside the step", parallel/reduce.py)."""

import math
from dataclasses import astuple, dataclass

import numpy as np

from capstone.model.fingerprint import sum_squares
from capstone.model.params import DTYPE, Layout


@dataclass(frozen=True)
class Flags:
    """What the ranks agree on at each step (set on any rank): a stop, rank 0's clock, a background checkpoint write."""

    stop: bool = False
    clock_due: bool = False
    writing: bool = False

    def counts(self) -> tuple[float, ...]:
        return tuple(map(float, astuple(self)))   # each flag as 0 or 1, to be summed over the ranks

    @classmethod
    def any_rank(cls, sums) -> "Flags":
        """The flags set on any rank, from `counts()` summed over the ranks."""
        return cls(*(bool(n > 0) for n in sums))


@dataclass(frozen=True)
class GradStats:
    """Global facts about one step's reduced gradient (identical on every rank)."""

    loss: float     # the summed, scaled loss of the global batch
    norm: float     # L2 norm of the whole reduced gradient
    flags: Flags


class GradReducer:
    """The interface, and the step's one small allreduce (subclasses fill `grad_shard`)."""

    accumulates = True   # micro-batch gradients add up in the flat buffer (else each is reduced alone)
    ahead = staticmethod(lambda grad: None)   # post-validation's update taken ahead (capstone.parallel.postvalidation)

    def __init__(self, grid, layout: Layout, grads: np.ndarray | None, loss_weight: float = 1.0):
        """`grads`: the flat gradient buffer the backward pass lands in (None: ZeRO-2/3 keep none)."""
        if layout.world != grid.dp.size:
            raise ValueError(f"layout is padded for {layout.world} ranks but the data-parallel group has {grid.dp.size}")
        if grads is not None and (grads.dtype != DTYPE or grads.shape != (layout.padded,) or not grads.flags.c_contiguous):
            raise ValueError(f"grads must be a contiguous float32 buffer of length {layout.padded}")
        self.world, self.dp, self.layout, self.grads = grid.world, grid.dp, layout, grads
        self.grad_shard = np.zeros(layout.shard, dtype=DTYPE)
        self.norm_weight, self.loss_weight = grid.norm_weight(layout), loss_weight

    def start(self, micro_batches: int) -> None:
        """Before the step's first forward pass."""

    def before_backward(self, micro: int) -> None:
        """Before micro-batch `micro`'s backward pass (a pipeline runs them out of order)."""

    def landed(self, group: str, grad: np.ndarray) -> None:
        """Group `group`'s gradient has landed (the model's seam calls it; `grad`: its slice of `grads` or itself)."""

    def after_backward(self, micro: int) -> None:
        """After micro-batch `micro`'s backward pass (its gradient is in `grads`)."""

    def finish(self, losses: list[float], flags: Flags) -> GradStats:
        """Collective: call on all ranks after the last backward pass."""
        raise NotImplementedError

    def stats(self, loss: float, flags: Flags, sumsq: float | None = None) -> GradStats:
        """Collective over the world: one allreduce of [sum of squares, loss, *flags]."""
        mine = sum_squares(self.grad_shard, self.norm_weight) if sumsq is None else sumsq
        self.agreeing()
        total = self.world.sum([mine, loss * self.loss_weight, *flags.counts()],
                               "allreduce of the gradient norm and loss", "allreduce_stats")
        return GradStats(total[1], math.sqrt(total[0]), Flags.any_rank(total[2:]))

    def agreeing(self) -> None:
        """Before the world agrees on the step (its norm measured): the gradient is final (the `reduced` test seam)."""
        self.dp.hooks.reduced(self.dp.hooks.step, self.grad_shard)
        self.ahead(self.grad_shard)

    def nbytes(self) -> int:
        """Bytes this reduction holds besides the flat gradient buffer (the received shard...)."""
        return self.grad_shard.nbytes

    def bound(self, micro_batches: int) -> int:
        """The formula for `nbytes` in a step of `micro_batches` (capstone.observe.memory)."""
        raise NotImplementedError
