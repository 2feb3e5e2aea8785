"""The held-out evaluation on fixed batches never trained on (docs/design.md, "Inside the step", data/heldout.py)."""


class HeldOut:
    """This rank's rows of the held-out batches of `data` (`val_batch(k, S, rank, dp)`)."""

    def __init__(self, data, batches: int, batch_size: int, seq_len: int, world, dp_rank: int, dp: int,
                 loss, weight: float = 1.0):
        self.world, self.weight, self.loss = world, weight, loss
        self.batches = [data.val_batch(k, batch_size, dp_rank, dp) for k in range(batches)]
        self.scale = 1.0 / (batches * batch_size * seq_len)

    def loss_share(self) -> float:
        """This rank's part of the mean held-out loss per token."""
        return sum(self.loss(x, y, self.scale) for x, y in self.batches if len(x)) * self.weight

    def after_update(self, finite: bool, evaluate: bool) -> tuple[float | None, bool]:
        """Collective over the world: (the held-out loss if `evaluate` else None, every rank's state finite)."""
        share = self.loss_share() if evaluate else 0.0
        held, nonfinite = self.world.sum([share, float(not finite)], "allreduce of the held-out loss", "allreduce_eval")
        return (held if evaluate else None), nonfinite == 0

    def measure(self) -> float:
        """Collective over the world: the held-out loss of the current parameters."""
        return self.world.sum([self.loss_share()], "allreduce of the held-out loss", "allreduce_eval")[0]
