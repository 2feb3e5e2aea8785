"""What a run's checkpoint restores besides the optimizer shards, as one typed object.

`RunState` is where the run is (step, data cursor) and what it has judged so far (the guard's
state, the start and best held-out loss that invariant (a) measures against, the rollbacks); the
per-step history lives in metrics.jsonl, not in every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from capstone.guard import GuardState


@dataclass
class RunState:
    """Progress of one run; mutated by the training loop, saved in every checkpoint."""

    step: int = 0                       # optimizer steps done
    cursor: int = 0                     # first global sample of the next step
    eval_start: float | None = None     # held-out loss of the initial parameters
    best_eval: float | None = None      # lowest held-out loss of an accepted state so far
    losses: list = field(default_factory=list)     # (step, train loss, held-out loss | None) of this segment's
    rollbacks: list = field(default_factory=list)  # the guard's rollback events
    guard: GuardState = field(default_factory=GuardState)
    best_step: int | None = None        # the step of best_eval (None: the start, or an older checkpoint)

    def to_json(self) -> dict:
        return {"step": self.step, "data_cursor": self.cursor, "eval_start": self.eval_start,
                "best_eval": self.best_eval, "rollbacks": self.rollbacks, "guard": self.guard.to_json(),
                "best_step": self.best_step}

    @classmethod
    def from_json(cls, data: dict) -> "RunState":
        return cls(step=int(data["step"]), cursor=int(data["data_cursor"]), eval_start=data["eval_start"],
                   best_eval=data["best_eval"], rollbacks=list(data["rollbacks"]),
                   guard=GuardState.from_json(data["guard"]), best_step=data.get("best_step"))

    def accepted(self, step: int, loss: float, eval_loss: float | None) -> None:
        self.losses.append((step, loss, eval_loss))
        if eval_loss is not None and (self.best_eval is None or eval_loss < self.best_eval):
            self.best_eval, self.best_step = eval_loss, step
