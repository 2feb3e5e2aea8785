"""The one test seam: named points of a run where a test may act on it.

How it works: docs/design.md, "Inside the step", hooks.py."""

from __future__ import annotations


class Hooks:
    """No faults: every hook leaves the run alone."""

    step: int | None = None   # the step running (set by at("step", step))

    def at(self, point: str, step: int | None = None) -> None:
        if point == "step":
            self.step = step

    def gradients(self, step: int, micro: int, grads) -> None:
        pass

    def reduced(self, step: int, grad_shard) -> None:
        pass

    def learning_rate(self, step: int, lr: float) -> float:
        return lr

    def parameters(self, step: int, params) -> None:
        pass

    def step_done(self, step: int) -> None:
        pass


NONE = Hooks()
