"""The run's side of checkpoints: when to save, what goes in, what comes back, and what was saved.

Saves every `ckpt_every` steps, when `ckpt_every_minutes` of wall clock have passed (rank 0's
clock, agreed by the caller), on a stop request and at the last step. The first save of a run is
snapshotted in memory so invariant (d) can check it reloads byte-equal. File format and I/O are
`checkpoint`'s.
"""

from __future__ import annotations

import time

import numpy as np

from capstone import checkpoint
from capstone.state import RunIdentity, RunState
from capstone.parallel.zero import ShardState


class Checkpointer:
    """Checkpoints of one run in `directory` (collective methods: call on all ranks)."""

    def __init__(self, dist, directory: str, layout, identity: RunIdentity):
        self.dist, self.directory, self.layout, self.identity = dist, directory, layout, identity
        tcfg = identity.train
        self.every, self.minutes, self.keep_last = tcfg.ckpt_every, tcfg.ckpt_every_minutes, tcfg.keep_last
        self.manifests: list[dict] = []
        self.snapshot: np.ndarray | None = None   # (rows, shard) of the first save, for invariant (d)
        self.provenance: dict | None = None       # capstone.provenance.collect, set by run.start
        self.last_save = time.monotonic()

    def clock_due(self) -> bool:
        """Whether the wall-clock interval has passed on this rank (the caller agrees on rank 0's)."""
        return self.minutes > 0 and time.monotonic() - self.last_save >= 60 * self.minutes

    def due(self, step: int, clock: bool, stop: bool, last: bool) -> bool:
        return bool(self.every and step % self.every == 0) or clock or stop or last

    def save(self, state: RunState, shard: ShardState) -> dict:
        """Collective. Write checkpoint `state.step`; returns its manifest."""
        extra = {**self.identity.to_json(), "run": state.to_json(), "provenance": self.provenance,
                 **self.extra()}
        stored = self.to_stored(shard)
        protect = [self.manifests[0]["path"]] if self.manifests else []
        man = checkpoint.save(self.dist, self.directory, state.step, stored, self.layout, extra,
                              self.keep_last, protect)
        if self.snapshot is None:
            self.snapshot = np.stack(stored.rows())
        self.manifests.append(man)
        self.last_save = time.monotonic()
        return man

    def load(self, path: str) -> tuple[ShardState, RunState, dict]:
        """Collective. Load `path` (any world size), refusing another model or data stream."""
        stored, meta = checkpoint.load(self.dist, path, self.layout, self.identity.must_match())
        return self.from_stored(stored), RunState.from_json(meta["run"]), meta

    # What the file holds, when it is not this rank's shard as the optimizer has it (tensor
    # parallelism stores the canonical 1-rank vectors and re-slices them: `tp.TPCheckpointer`).
    def to_stored(self, shard: ShardState) -> ShardState:
        return shard

    def from_stored(self, stored: ShardState) -> ShardState:
        return stored

    def extra(self) -> dict:
        return {}

    def verify_first(self) -> dict | None:
        """Collective. Reload the run's first checkpoint and compare it with its snapshot (d)."""
        if not self.manifests:
            return None
        return checkpoint.verify_snapshot(self.dist, self.manifests[0]["path"], self.layout,
                                          self.identity.must_match(), self.snapshot)
