"""The one test seam: named points of a run where a test may act on it.

`Hooks` does nothing, and is what every run uses unless a test asks for faults
(capstone.faults implements it from CAPSTONE_FAULT and the --inject-* / --sleep-per-step flags).
The run calls:

  at(point)                    "step" at the start of each step (it carries the step number), every
                               collective by its kind (capstone.collective.comm: "reduce_scatter",
                               "allreduce_stats", "tp_allreduce", ...), and the checkpoint's crash
                               points ("save.before_data", "publish.between_renames", ...)
  gradients(step, micro, g)    after micro-batch `micro`'s backward, on the flat gradient buffer
  reduced(step, grad_shard)    after the reduction, on this rank's shard of the summed gradient
  learning_rate(step, lr)      the learning rate the update will use
  parameters(step, params)     after the step's update, on the flat parameter buffer
  step_done(step)              at the end of the step
"""

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
