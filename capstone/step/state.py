"""What a checkpoint restores: this rank's optimizer shard (`ShardState`, owned by ZeroAdam) and the run's progress."""

from dataclasses import asdict, dataclass, field

import numpy as np

from capstone.step.guard import GuardState
from capstone.model.params import DTYPE

ROWS = ("master", "m", "v")  # the arrays of a shard's optimizer state, in checkpoint row order
_ZEROS = np.zeros(1024, dtype=DTYPE)


def _finite(a: np.ndarray) -> bool:
    """Whether every value of a is finite, in one BLAS pass (rows of 1024 values times a zero vector)."""
    full = a.size - a.size % _ZEROS.size
    with np.errstate(invalid="ignore"):
        rows = np.dot(a[:full].reshape(-1, _ZEROS.size), _ZEROS)
    return bool(np.isfinite(rows).all() and np.isfinite(a[full:]).all())


@dataclass
class ShardState:
    """One rank's ZeRO-1 optimizer state: fp32 master copy, Adam m and v of its shard; Adam step t."""

    master: np.ndarray
    m: np.ndarray
    v: np.ndarray
    t: int = 0

    def rows(self) -> list[np.ndarray]:
        return [getattr(self, r) for r in ROWS]

    def copy_from(self, other: "ShardState") -> None:
        for r, src, dst in zip(ROWS, other.rows(), self.rows()):
            if src.shape != dst.shape:
                raise ValueError(f"{r} shard has shape {src.shape}, this rank needs {dst.shape}")
            dst[...] = src
        self.t = int(other.t)

    def finite(self) -> bool:
        """No NaN or infinity in master, m or v."""
        return all(_finite(a) for a in self.rows())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.rows())


@dataclass
class RunState:
    """Where the run is, what it has judged; in every checkpoint (not the per-step history: metrics.jsonl)."""

    step: int = 0                       # optimizer steps done
    cursor: int = 0                     # first global sample of the next step
    eval_start: float | None = None     # held-out loss of the initial parameters
    best_eval: float | None = None      # lowest held-out loss of an accepted state so far
    losses: list = field(default_factory=list)     # (step, train loss, held-out loss | None) of this segment's
    rollbacks: list = field(default_factory=list)  # the guard's rollback events
    guard: GuardState = field(default_factory=GuardState)
    best_step: int | None = None        # the step of best_eval (None: the start, or an older checkpoint)
    run_id: str | None = None           # which run this is (capstone.checkpoint.rundir; None: an older checkpoint)

    def to_json(self) -> dict:
        return {"step": self.step, "data_cursor": self.cursor, "eval_start": self.eval_start,
                "best_eval": self.best_eval, "rollbacks": self.rollbacks, "guard": asdict(self.guard),
                "best_step": self.best_step, "run_id": self.run_id}

    @classmethod
    def from_json(cls, data: dict) -> "RunState":
        return cls(step=int(data["step"]), cursor=int(data["data_cursor"]), eval_start=data["eval_start"],
                   best_eval=data["best_eval"], rollbacks=list(data["rollbacks"]), guard=GuardState(**data["guard"]),
                   best_step=data.get("best_step"), run_id=data.get("run_id"))

    def accepted(self, step: int, loss: float, eval_loss: float | None) -> None:
        self.losses.append((step, loss, eval_loss))
        if eval_loss is not None and (self.best_eval is None or eval_loss < self.best_eval):
            self.best_eval, self.best_step = eval_loss, step
