"""The run's side of checkpoints: when to save (and evaluate), what goes in, what comes back, and
what was saved.

Saves every `ckpt_every` steps, when `ckpt_every_minutes` of wall clock have passed (rank 0's
clock, agreed by the ranks), on a stop request and at the last step; evaluates every `eval_every`
steps and at every save. The file holds the canonical 1-rank vectors sharded over the world ranks;
`view` converts this rank's optimizer shard to and from that (as is without tensor parallelism,
capstone.parallel.tensor.Canonical with it). The first save of a run is snapshotted in memory so
invariant (d) can check it reloads byte-equal. File format and I/O are `capstone.checkpoint`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from capstone import checkpoint
from capstone.hooks import NONE
from capstone.state import RunIdentity, RunState
from capstone.parallel.zero import ShardState


@dataclass(frozen=True)
class Due:
    """What a step must do besides training, decided once from the cadence and the agreed flags."""

    checkpoint: bool
    evaluate: bool
    stop: bool       # a stop before the last step (a signal, --stop-after): save, then end


class AsIs:
    """The stored vectors are this rank's optimizer shard itself (data parallelism alone)."""

    def to_stored(self, shard: ShardState) -> ShardState:
        return shard

    def from_stored(self, shard: ShardState) -> ShardState:
        return shard

    def whole(self, params):
        return params

    def describe(self) -> dict:
        return {}


class Checkpointer:
    """Checkpoints of one run in `directory` (collective methods: call on all ranks)."""

    def __init__(self, comm, directory: str, layout, identity: RunIdentity, view=None, hooks=NONE,
                 stop_after: int = 0):
        self.comm, self.directory, self.layout, self.identity = comm, directory, layout, identity
        self.view, self.hooks, self.stop_after = view or AsIs(), hooks, stop_after
        tcfg = identity.train
        self.every, self.minutes, self.keep_last = tcfg.ckpt_every, tcfg.ckpt_every_minutes, tcfg.keep_last
        self.eval_every, self.steps = tcfg.eval_every, tcfg.steps
        self.manifests: list[dict] = []
        self.snapshot: np.ndarray | None = None   # (rows, shard) of the first save, for invariant (d)
        self.provenance: dict | None = None       # capstone.observe.provenance.collect, set by run.start
        self.last_save = time.monotonic()

    def clock_due(self) -> bool:
        """Whether the wall-clock interval has passed on this rank (the ranks agree on rank 0's)."""
        return self.comm.rank == 0 and self.minutes > 0 and time.monotonic() - self.last_save >= 60 * self.minutes

    def due(self, step: int, flags) -> Due:
        """Checkpoint every K steps, on the wall clock, on a stop and at the last step; evaluate
        every eval_every steps and at every checkpoint."""
        stop, last = flags.stop or step == self.stop_after, step == self.steps
        ckpt = bool(self.every and step % self.every == 0) or flags.clock_due or stop or last
        return Due(ckpt, step % self.eval_every == 0 or ckpt, stop and not last)

    def save(self, state: RunState, shard: ShardState) -> dict:
        """Collective. Write checkpoint `state.step`; returns its manifest."""
        extra = {**self.identity.to_json(), "run": state.to_json(), "provenance": self.provenance,
                 **self.view.describe()}
        stored = self.view.to_stored(shard)
        protect = [self.manifests[0]["path"]] if self.manifests else []
        man = checkpoint.save(self.comm, self.directory, state.step, stored, self.layout, extra,
                              self.keep_last, protect, self.hooks)
        if self.snapshot is None:
            self.snapshot = np.stack(stored.rows())
        self.manifests.append(man)
        self.last_save = time.monotonic()
        return man

    def load(self, path: str) -> tuple[ShardState, RunState, dict]:
        """Collective. Load `path` (any world size or grid), refusing another model or data stream."""
        stored, meta = checkpoint.load(self.comm, path, self.layout, self.identity.must_match())
        return self.view.from_stored(stored), RunState.from_json(meta["run"]), meta

    def verify_first(self) -> dict | None:
        """Collective. Reload the run's first checkpoint and compare it with its snapshot (d)."""
        if not self.manifests:
            return None
        return checkpoint.verify_snapshot(self.comm, self.manifests[0]["path"], self.layout,
                                          self.identity.must_match(), self.snapshot)
