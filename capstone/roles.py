"""What one training run holds (`Run`, built by capstone.run from its plan), and the roles of its parts as Protocols
(docs/design.md, "Inside the step", roles.py)."""

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
    """This rank's part of the one model (capstone.model.gpt.Model: whole, a stage, a tp slice) over its seam."""

    layout: Layout
    params: np.ndarray   # this rank's flat parameter buffer (ZeRO-3: its shard)

    def micro_batch(self, x: np.ndarray, y: np.ndarray, scale: float, fresh: bool) -> float: ...
    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float: ...
    def whole(self) -> np.ndarray: ...


class Schedule(Protocol):
    """Micro-batches through forward and backward, a batch forward only (schedules.Sequential, pipeline.Pipeline)."""

    def forward_backward(self, batches: list, step: int) -> list[float]: ...
    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float: ...


class Batches(Protocol):
    """This dp rank's rows of micro-batch `micro` of the step at `cursor` (synthetic.DataStream, token datasets)."""

    def micro_batch(self, cursor: int, micro: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]: ...


class StateView(Protocol):
    """The optimizer shard as checkpoints store it: the 1-rank layout, any grid (saver.AsIs, canonical.Canonical)."""

    def to_stored(self, shard: ShardState) -> ShardState: ...
    def from_stored(self, shard: ShardState) -> ShardState: ...
    def whole(self, params: np.ndarray) -> np.ndarray: ...
    def describe(self) -> dict: ...


class Replicas(Protocol):
    """Invariant (b): each parameter's replicas agree at every step (replicas.ReplicaCheck, zero3's)."""

    checked: int
    mismatches: list

    def check(self, step: int, params: np.ndarray, strong: bool) -> tuple[float, str]: ...


@dataclass(kw_only=True)
class Run:
    """Everything one run holds (who owns what: see the module)."""

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
