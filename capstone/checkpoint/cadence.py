"""When a step must save a checkpoint and evaluate, decided once per step from the agreed flags
(docs/design.md, "Inside the step", checkpoint/cadence.py)."""

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Due:
    """What a step must do besides training."""

    checkpoint: bool
    evaluate: bool
    stop: bool       # a stop before the last step: save, then end
    abandon: bool = False   # a signal's stop: this step's update is not applied, the state before it is saved
    writing: bool = False   # a rank's background checkpoint write still runs (none: its outcome is taken now)


class Cadence:
    def __init__(self, tcfg, rank: int, stop_after: int = 0):
        self.every, self.minutes, self.eval_every = tcfg.ckpt_every, tcfg.ckpt_every_minutes, tcfg.eval_every
        self.steps, self.stop_after, self.rank = tcfg.steps, stop_after, rank
        self.last_save = time.monotonic()

    def clock_due(self) -> bool:
        """Rank 0: whether the wall-clock interval has passed since the last save (False elsewhere)."""
        return self.rank == 0 and self.minutes > 0 and time.monotonic() - self.last_save >= 60 * self.minutes

    def due(self, step: int, flags) -> Due:
        if flags.stop:   # a signal, agreed by every rank: stop now, before this step's update
            return Due(True, False, True, abandon=True, writing=flags.writing)
        stop, last = step == self.stop_after, step == self.steps
        ckpt = bool(self.every and step % self.every == 0) or flags.clock_due or stop or last
        return Due(ckpt, step % self.eval_every == 0 or ckpt, stop and not last, writing=flags.writing)

    def saved(self) -> None:
        self.last_save = time.monotonic()
