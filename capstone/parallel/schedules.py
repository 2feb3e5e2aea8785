"""How a step's micro-batches go through forward and backward: `Sequential`, each in turn on this rank's model
(docs/design.md, "Inside the step", parallel/schedules.py)."""


class Sequential:
    """The micro-batches of a step one after another (`scale`: 1 / tokens of the global batch)."""

    def __init__(self, model, reducer, hooks, scale: float):
        self.model, self.reducer, self.hooks, self.scale = model, reducer, hooks, scale

    def forward_backward(self, batches: list, step: int) -> list[float]:
        """Collective: call on all ranks. Every micro-batch's (scaled, summed) loss, in order."""
        self.reducer.start(len(batches))
        self.model.begin(step)
        self.model.seam.step(True)
        losses = []
        for j, (x, y) in enumerate(batches):
            self.reducer.before_backward(j)
            losses.append(self.model.micro_batch(x, y, self.scale, j == 0 or not self.reducer.accumulates))
            self.hooks.gradients(step, j, self.model.grads)
            self.reducer.after_backward(j)
        self.model.seam.step(False)
        return losses

    def loss(self, x, y, scale: float) -> float:
        """scale * summed loss of one batch, forward only (the held-out evaluation's)."""
        return self.model.loss(x, y, scale)
