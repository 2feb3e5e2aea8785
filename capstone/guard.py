"""Divergence guard: decide, from globally agreed numbers, whether a step must be rolled back.

The loop feeds it the global loss and gradient norm (identical on every rank after one small
Allreduce) and whether the update it just applied left every rank's state finite, so every rank
reaches the same verdict without further communication. The guard keeps `good`, a copy of this
rank's optimizer shard state that produced the last accepted loss; restoring it is the rollback.

Triggers count as consecutive until training makes progress again: a loss is accepted from a
state that an update produced (not one just restored). So a run whose every update diverges
(e.g. --lr 1e4) stops after --max-rollbacks instead of alternating restore / bad update forever.
Its state (good copy, last loss, counters) is saved in checkpoints so a resumed run decides exactly
as the uninterrupted one would.
"""

from __future__ import annotations

import math

import numpy as np

ARRAYS = ("master", "m", "v")


class DivergenceError(RuntimeError):
    """The guard fired more times in a row than allowed."""


class Guard:
    """Non-finite loss/gradient/update and loss-spike detection with bounded consecutive rollbacks."""

    def __init__(self, spike_factor: float = 2.0, max_consecutive: int = 3):
        self.spike_factor, self.max_consecutive = spike_factor, max_consecutive
        self.last_loss: float | None = None
        self.consecutive = 0
        self.restored = False   # the live state is a restored one: no update has been accepted since
        self.good: dict | None = None

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """None if the step may be applied, else the reason: the current parameters are suspect
        for 'loss_nonfinite' and 'loss_spike'; only the batch's gradient for 'grad_nonfinite'."""
        if not math.isfinite(loss):
            return "loss_nonfinite"
        if self.last_loss is not None and loss > self.spike_factor * self.last_loss:
            return "loss_spike"
        if not math.isfinite(grad_norm):
            return "grad_nonfinite"
        return None

    def remember(self, loss: float | None, state: dict) -> None:
        """`state` (live arrays) produced the accepted `loss` (None: a start state): copy it.
        An accepted loss from a state an update produced is progress: the trigger count resets."""
        if loss is not None:
            self.last_loss = loss
            if not self.restored:
                self.consecutive = 0
            self.restored = False
        if self.good is None:
            self.good = {k: np.array(state[k]) for k in ARRAYS}
        else:
            for k in ARRAYS:
                np.copyto(self.good[k], state[k])
        self.good["t"] = int(state["t"])

    def triggered(self, step: int, reason: str) -> dict:
        """Count a trigger (raise DivergenceError past the allowed number in a row) and return
        the good state to restore."""
        self.consecutive += 1
        self.restored = True
        if self.consecutive > self.max_consecutive:
            raise DivergenceError(
                f"divergence guard fired {self.consecutive} times without progress (last at step {step}: "
                f"{reason}); stopping instead of looping. Lower --lr, set --clip, or resume from an "
                f"earlier checkpoint.")
        return self.good

    def nbytes(self) -> int:
        return 0 if self.good is None else sum(self.good[k].nbytes for k in ARRAYS)

    def to_meta(self) -> dict:
        """The scalar state, for checkpoints (the good arrays are saved as shard rows)."""
        return {"last_loss": self.last_loss, "consecutive": self.consecutive, "restored": self.restored,
                "good_t": None if self.good is None else self.good["t"]}

    def from_checkpoint(self, meta: dict, arrays: dict) -> None:
        """Restore what `to_meta` and the good rows of a checkpoint hold."""
        self.last_loss, self.consecutive = meta["last_loss"], meta["consecutive"]
        self.restored = meta["restored"]
        self.good = {k: np.array(arrays[k]) for k in ARRAYS}
        self.good["t"] = int(meta["good_t"])
