"""The roles of a run's parts, as Protocols: what the run and its training loop ask of each part,
whichever mode made it (capstone.modes). The gradient reducer's role is the class
capstone.parallel.reduce.GradReducer, whose implementations share its one small allreduce.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from capstone.model.params import Layout
from capstone.state import ShardState


class TrainedModel(Protocol):
    """This rank's part of the model: the whole model, a pipeline stage's groups, a tensor-parallel
    slice or a ZeRO-3 shard (capstone.model.gpt.Model, pipeline.StageModel, zero3.ShardedModel)."""

    layout: Layout
    params: np.ndarray   # this rank's flat parameter buffer (ZeRO-3: its shard)

    def micro_batch(self, x: np.ndarray, y: np.ndarray, scale: float, fresh: bool) -> float: ...
    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float: ...
    def whole(self) -> np.ndarray: ...


class Schedule(Protocol):
    """How a step's micro-batches go through forward and backward (parallel.schedules.Sequential,
    parallel.pipeline.Pipeline)."""

    def forward_backward(self, batches: list, step: int) -> list[float]: ...


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
