"""The one test seam: named points of a run where a test may act on it (docs/design.md, "Inside the step", hooks.py)."""


class Hooks:
    """No faults: every hook leaves the run alone."""

    step: int | None = None   # the step running (set by at("step", step))

    def at(self, point: str, step: int | None = None) -> None:
        if point == "step":
            self.step = step

    def gradients(self, step: int, micro: int, grads) -> None: ...     # a micro-batch's, before the reducer's
    def reduced(self, step: int, grad_shard) -> None: ...               # the step's reduced shard
    def learning_rate(self, step: int, lr: float) -> float: return lr   # the step's
    def parameters(self, step: int, params) -> None: ...                # after the update (or its undo)
    def step_done(self, step: int) -> None: ...


NONE = Hooks()
