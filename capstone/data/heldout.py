"""The held-out evaluation: a fixed set of M batches of S sequences never trained on, split
across ranks by rows; forward only. Summed over ranks, `loss_share` is the mean loss per token."""

from __future__ import annotations


class HeldOut:
    """This rank's rows of the held-out batches of `data` (`val_batch(k, S, rank, world)`)."""

    def __init__(self, data, batches: int, batch_size: int, seq_len: int, rank: int, world: int):
        self.batches = [data.val_batch(k, batch_size, rank, world) for k in range(batches)]
        self.scale = 1.0 / (batches * batch_size * seq_len)

    def loss_share(self, model) -> float:
        return sum(model.loss(x, y, self.scale) for x, y in self.batches if len(x))
