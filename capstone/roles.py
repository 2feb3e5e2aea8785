"""What one training run holds (`Run`, built by capstone.run from its plan), and the roles of its
parts as Protocols: what the run and its training loop ask of each part, whichever mode made it
(capstone.modes; the gradient reducer's role is the class capstone.parallel.reduce.GradReducer).

Each piece of state has one owner: the model's seam the parameter and gradient buffers
(capstone.model.seam), the reducer the reduced gradient shard, `ZeroAdam` the optimizer shard and
the state before its last update (the guard's undo), `Checkpointer` what was saved, `RunState`
the progress a checkpoint restores, the replica check invariant (b)'s record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from capstone.model.fingerprint import fingerprint
from capstone.model.params import Layout
from capstone.step.state import RunState, ShardState

if TYPE_CHECKING:   # the parts' classes, named for the reader (no import at run time)
    from capstone.checkpoint.cadence import Cadence
    from capstone.checkpoint.saver import Checkpointer
    from capstone.config import ModelConfig, TrainConfig
    from capstone.data.heldout import HeldOut
    from capstone.step.guard import Guard
    from capstone.step.hooks import Hooks
    from capstone.observe.report import MetricsLog
    from capstone.flags.options import RunOptions
    from capstone.parallel.grid import Grid
    from capstone.parallel.reduce import GradReducer
    from capstone.parallel.zero import ZeroAdam
    from capstone.plan import Plan


class TrainedModel(Protocol):
    """This rank's part of the model: the one model class (capstone.model.gpt.Model) over the whole
    model's groups or a pipeline stage's, a tensor-parallel slice, with the seam the modes chose."""

    layout: Layout
    params: np.ndarray   # this rank's flat parameter buffer (ZeRO-3: its shard)

    def micro_batch(self, x: np.ndarray, y: np.ndarray, scale: float, fresh: bool) -> float: ...
    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float: ...
    def whole(self) -> np.ndarray: ...


class Schedule(Protocol):
    """How a step's micro-batches go through forward and backward, and a batch through the forward
    alone (parallel.schedules.Sequential, parallel.pipeline.Pipeline)."""

    def forward_backward(self, batches: list, step: int) -> list[float]: ...
    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float: ...


class Batches(Protocol):
    """The training data: micro-batch `micro` of the step at `cursor`, this data-parallel rank's
    rows (capstone.data.synthetic.DataStream, the token datasets)."""

    def micro_batch(self, cursor: int, micro: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]: ...


class StateView(Protocol):
    """The checkpoints' view of this rank's optimizer shard: stored in the 1-rank layout of the whole
    model, whatever the grid (capstone.checkpoint.saver.AsIs, parallel.canonical.Canonical)."""

    def to_stored(self, shard: ShardState) -> ShardState: ...
    def from_stored(self, shard: ShardState) -> ShardState: ...
    def whole(self, params: np.ndarray) -> np.ndarray: ...
    def describe(self) -> dict: ...


class Replicas(Protocol):
    """Invariant (b): the replicas of each parameter hold the same values at every step
    (parallel.replicas.ReplicaCheck, zero3.ShardedReplicaCheck)."""

    checked: int
    mismatches: list

    def check(self, step: int, params: np.ndarray, strong: bool) -> tuple[float, str]: ...


@dataclass(kw_only=True)
class Run:
    """Everything one run holds (see the module for who owns what)."""

    grid: Grid
    plan: Plan                             # how the run is laid out (capstone.plan)
    mcfg: ModelConfig
    tcfg: TrainConfig
    opts: RunOptions
    out: str
    model: TrainedModel
    opt: ZeroAdam
    reducer: GradReducer
    schedule: Schedule
    data: Batches
    heldout: HeldOut
    guard: Guard
    cadence: Cadence
    ckpt: Checkpointer
    state: RunState
    replicas: Replicas
    hooks: Hooks
    batch_size: int                        # sequences per data-parallel rank per micro-batch
    global_batch: int                      # sequences per optimizer step, over all replicas and micro-batches
    n_params: int                          # of the whole model (a rank may hold a part)
    metrics: MetricsLog | None = None
    segment_start: tuple = (None, None)    # (held-out loss, best held-out loss) where this segment began
    resumed_from: str | None = None
    init_from: dict | None = None          # --init-from: the weights this run started from (capstone.gpt2.finetune)

    def final_fingerprint(self) -> tuple[float, str]:
        """Collective: the fingerprint of the whole model's parameters."""
        return fingerprint(self.ckpt.view.whole(self.model.whole()))
