"""Divergence guard: decide, from globally agreed numbers, whether a step is kept
(docs/design.md, "Inside the step", guard.py)."""

import math
from dataclasses import dataclass

UPDATE_REASONS = ("update_nonfinite", "eval_spike")


@dataclass
class GuardState:
    """What the guard has judged so far (checkpointed; the saved state itself is an accepted one)."""

    last_loss: float | None = None   # last accepted training loss
    last_eval: float | None = None   # held-out loss of the current accepted state
    consecutive: int = 0             # triggers since the last accepted update
    pending: bool = False            # the last update was accepted without a held-out evaluation


class DivergenceError(RuntimeError):
    """The guard fired more times in a row than allowed."""


class Guard:
    """Batch and update verdicts with bounded consecutive triggers."""

    def __init__(self, spike_factor: float = 2.0, max_consecutive: int = 3, state: GuardState | None = None, undo=True):
        self.spike_factor, self.max_consecutive, self.undo = spike_factor, max_consecutive, undo
        self.state = GuardState() if state is None else state  # updated in place (a RunState holds it)

    def batch_verdict(self, loss: float, grad_norm: float) -> str | None:
        """None if the batch may be used for an update, else why it is skipped."""
        if not math.isfinite(loss):
            return "loss_nonfinite"
        last = self.state.last_loss
        if last is not None and loss > self.spike_factor * last:
            return "loss_spike"
        if not math.isfinite(grad_norm):
            return "grad_nonfinite"
        return None

    def update_verdict(self, eval_loss: float | None, state_finite: bool) -> str | None:
        """None if the update just applied may be kept, else why to undo it (`eval_loss` None: finiteness only)."""
        if not state_finite or eval_loss is not None and not math.isfinite(eval_loss):
            return "update_nonfinite"
        last = self.state.last_eval
        if self.undo and eval_loss is not None and last is not None and eval_loss > self.spike_factor * last:
            return "eval_spike"
        return None

    def accept(self, loss: float, eval_loss: float | None) -> None:
        """The update was kept: training made progress."""
        self.state.last_loss, self.state.consecutive, self.state.pending = loss, 0, eval_loss is None
        if eval_loss is not None:
            self.state.last_eval = eval_loss

    def undoes(self, reason: str) -> bool:
        """Whether a trigger for `reason` must revert the last update (it was applied and is not kept)."""
        return self.undo and (reason in UPDATE_REASONS or self.state.pending)

    def triggered(self, step: int, reason: str) -> None:
        """Count a trigger; raise DivergenceError past the allowed number without progress."""
        if reason in UPDATE_REASONS and not self.undo:
            raise DivergenceError(f"step {step}: the update made the optimizer state or the held-out loss non-finite, "
                                  f"and --no-guard-undo keeps no copy to undo it; stopping before it is saved. Resume "
                                  f"from the last checkpoint (--resume latest) with a lower --lr or --clip.")
        self.state.consecutive, self.state.pending = self.state.consecutive + 1, False
        if self.state.consecutive > self.max_consecutive:
            raise DivergenceError(f"divergence guard fired {self.state.consecutive} times without progress (last "
                                  f"at step {step}: {reason}); stopping instead of looping. Lower --lr, set --clip, "
                                  f"or resume from an earlier checkpoint.")
