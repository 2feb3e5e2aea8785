"""Post-validation (with a zero-bubble schedule, --pp-schedule zb-h1; imported only then): the update is
taken before the step's checks, and kept, redone or dropped when they are known.

A zero-bubble pipeline's stages end their backwards at different times, and the step's global
checks (the gradient norm that clipping scales by, the guard's NaN and spike verdicts) need every
stage's numbers: a synchronisation before the update that brings a bubble back (Qi et al., ICLR
2024, "optimizer post-validation"). Here each stage takes its update ahead as soon as its own
gradient is reduced, from what it already has: Adam(W) at the step's learning rate, unclipped,
from the optimizer state into a spare state beside it (the reducer calls it just before the
world's agreement: capstone.parallel.reduce.GradReducer.agreeing). Then the checks, as before the
change, on the agreed numbers:

- the batch is kept and the norm did not reach --clip: the update taken ahead is the update (the
  same function on the same operands, `ZeroAdam.update` with a scale of 1), adopted by a swap of
  the states, as the guard's undo swaps them back;
- the norm exceeds --clip: the update is redone from the untouched state with clip / norm;
- the batch is rejected (a NaN, a loss spike): the update taken ahead is dropped, as if never made.

The state the guard's undo keeps (the one before the last update) is never touched by the update
taken ahead, so an undo after it restores what it restores under 1f1b. The result is the checked-
before schedule's, bit for bit. The spare state costs the optimizer's bytes again (12 per value of
the shard: capstone.observe.memory's guard row). `counts` says how often each case happened.
"""

import numpy as np

from capstone.step.state import ROWS, ShardState


class PostValidated:
    """A mix-in of the run's Adam (capstone.parallel.zero.ZeroAdam and its ZeRO-0 and ZeRO-3 kinds):
    `take_ahead` (the reducer's `ahead`) and an `apply` that adopts what it took when it is the update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spare = ShardState(*(np.zeros_like(self.state.master) for _ in ROWS))
        self.taken, self.made = None, {"taken": 0, "kept": 0, "redone": 0}

    @property
    def counts(self) -> dict:
        """The updates taken ahead so far: kept, redone, and dropped (taken and never applied: a rejected batch)."""
        m = self.made
        return {"kept": m["kept"], "redone": m["redone"], "dropped": m["taken"] - m["kept"] - m["redone"]}

    def take_ahead(self, grad_shard: np.ndarray, lr: float) -> None:
        """The step's update at learning rate `lr`, unclipped, from the state into the spare state."""
        self.update(grad_shard, lr, 1.0, self.state, self.spare)
        self.taken, self.made["taken"] = (lr, self.state), self.made["taken"] + 1

    def apply(self, grad_shard: np.ndarray, lr: float, norm: float) -> float:
        """ZeroAdam.apply's result: the update taken ahead when it is that update, else apply's own."""
        taken, self.taken = self.taken, None
        if taken is None or taken[0] != lr or taken[1] is not self.state or 0 < self.clip < norm:
            self.made["redone"] += taken is not None   # taken ahead, and not the update
            return super().apply(grad_shard, lr, norm)
        old = self.state
        self.state, self.spare = self.spare, old if self.before is None else self.before
        self.before, self.revertible = (None, False) if self.before is None else (old, True)
        self.made["kept"] += 1
        self._publish()
        return norm

    def before_nbytes(self) -> int:
        """The guard's copy and the spare state."""
        return super().before_nbytes() + self.spare.nbytes


def post_validated(adam: type) -> type:
    """The class `adam` with post-validation."""
    return type(f"PostValidated{adam.__name__}", (PostValidated, adam), {})
