"""Learning-rate schedule: linear warmup, then constant or cosine decay towards min_lr.

The cosine reaches min_lr one step after the last, so the last step still updates (with
min_lr 0, a schedule that hit it on the last step would make that step a no-op)."""

from __future__ import annotations

import math


def learning_rate(step: int, lr: float, steps: int, kind: str = "constant", warmup: int = 0, min_lr: float = 0.0) -> float:
    """Learning rate of optimizer step `step` (1-based) of a `steps`-step run."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if kind == "constant":
        return lr
    if kind == "cosine":
        span = max(1, steps - warmup)
        progress = min(1.0, (step - warmup - 1) / span)
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {kind!r}: use 'constant' or 'cosine'")


def at_step(step: int, tcfg) -> float:
    """The learning rate of optimizer step `step` under a TrainConfig's schedule."""
    return learning_rate(step, tcfg.lr, tcfg.steps, tcfg.lr_schedule, tcfg.warmup_steps, tcfg.min_lr)
