"""Divergence guard: decide, from globally agreed numbers, whether a step must be rolled back.

The loop feeds it the global loss and gradient norm (identical on every rank after one small
Allreduce), so every rank reaches the same verdict without further communication. The guard
keeps `good`, a copy of this rank's optimizer shard state that produced the last accepted loss;
restoring it is the rollback. Too many consecutive triggers end the run instead of looping.
"""

from __future__ import annotations

import math

import numpy as np


class DivergenceError(RuntimeError):
    """The guard fired more times in a row than allowed."""


class Guard:
    """Non-finite loss/gradient and loss-spike detection with bounded consecutive rollbacks."""

    def __init__(self, spike_factor: float = 2.0, max_consecutive: int = 3):
        self.spike_factor, self.max_consecutive = spike_factor, max_consecutive
        self.last_loss: float | None = None
        self.consecutive = 0
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

    def params_suspect(self, reason: str) -> bool:
        return reason in ("loss_nonfinite", "loss_spike")

    def remember(self, loss: float | None, state: dict) -> None:
        """`state` (live arrays) produced the accepted `loss` (None: a start state): copy it."""
        if loss is not None:
            self.last_loss = loss
        if self.good is None:
            self.good = {k: np.array(state[k]) for k in ("master", "m", "v")}
        else:
            for k in ("master", "m", "v"):
                np.copyto(self.good[k], state[k])
        self.good["t"] = state["t"]

    def accepted(self) -> None:
        self.consecutive = 0

    def triggered(self, step: int, reason: str) -> None:
        """Count a trigger; raise DivergenceError past the allowed number in a row."""
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise DivergenceError(
                f"divergence guard fired {self.consecutive} steps in a row (last at step {step}: {reason}); "
                f"stopping instead of looping. Lower --lr, enable --clip, or resume from an earlier checkpoint.")

    def nbytes(self) -> int:
        return 0 if self.good is None else sum(self.good[k].nbytes for k in ("master", "m", "v"))
