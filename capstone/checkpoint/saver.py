"""The run's side of checkpoints: what goes in, what comes back, and what was saved (when: the
cadence, capstone.checkpoint.cadence).

The file holds the canonical 1-rank vectors sharded over the world ranks;
`view` converts this rank's optimizer shard to and from that (as is without tensor parallelism,
capstone.parallel.canonical.Canonical with model parallelism). The first save of a run is snapshotted in memory so
invariant (d) can check it reloads byte-equal. File format and I/O are `capstone.checkpoint`'s.
"""

import dataclasses
import json
import os

import numpy as np

from capstone import checkpoint
from capstone.checkpoint import background, files, recover, tier
from capstone.config import ModelConfig, TrainConfig
from capstone.step.hooks import NONE
from capstone.step.state import RunState, ShardState


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """The configs of a run; a checkpoint resumes only into the same model and data stream."""

    model: ModelConfig
    train: TrainConfig
    data: dict            # the data stream's identity (e.g. seeds and corpus length)
    global_batch: int     # sequences per optimizer step
    modes: dict = dataclasses.field(default_factory=dict)   # how the run is laid out (capstone.checkpoint.kept)

    def to_json(self) -> dict:
        return {"model_config": dataclasses.asdict(self.model), "train_config": dataclasses.asdict(self.train),
                "data": self.data, "global_batch": self.global_batch, "modes": self.modes}

    def must_match(self) -> dict:
        """The metadata a checkpoint must hold, key by key, to be resumed by this run."""
        return {"model_config": dataclasses.asdict(self.model), "data": self.data}


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

    def __init__(self, comm, directory: str, layout, identity: RunIdentity, cadence, view=None, hooks=NONE,
                 writer=None):
        self.comm, self.directory, self.layout, self.identity = comm, directory, layout, identity
        self.cadence, self.view, self.hooks = cadence, view or AsIs(), hooks
        self.writer = writer   # capstone.checkpoint.background.Writer: saves written behind training (None: sync)
        self.buffer = background.Snapshot(layout.shard) if writer is not None else None
        self.manifests: list[dict] = []
        self.snapshot: np.ndarray | None = None   # (rows, shard) of the first save, for invariant (d)
        self.provenance: dict | None = None       # capstone.observe.provenance.collect, set by run.start
        self.last_judged: str | None = None       # the newest checkpoint of this run the guard judged
        self.tier = None   # capstone.checkpoint.tier.MemoryTier with --memory-tier (made at its first step)

    def extra(self, state: RunState) -> dict:
        """The run's metadata a checkpoint of `state` holds."""
        return {**self.identity.to_json(), "run": state.to_json(), "provenance": self.provenance,
                **self.view.describe()}

    def save(self, state: RunState, shard: ShardState, judged: bool = True) -> dict:
        """Collective. Write checkpoint `state.step`; returns its manifest. `judged` False (a stop's
        checkpoint of a state the guard has not judged): so marked in its metadata, and the newest
        judged checkpoint is kept from --keep-last's rotation, as the fall-back of its judgement."""
        self.drain()   # one write in flight: the previous one is published first
        extra = {**self.extra(state), "judged": judged}
        stored = self.view.to_stored(shard)
        protect = [self.manifests[0]["path"]] if self.manifests else []
        protect += [self.last_judged] if self.last_judged and not judged else []
        if self.writer is None:
            man = self._written(checkpoint.save(self.comm, self.directory, state.step, stored, self.layout, extra,
                                                self.identity.train.keep_last, protect, self.hooks), judged)
            self.snapshot = np.stack(stored.rows()) if self.snapshot is None else self.snapshot
        else:   # the snapshot: the rows and the run state copied now, written by the thread
            rows, extra, t, step = self.buffer.take(stored), json.loads(json.dumps(extra)), int(stored.t), state.step
            self.snapshot = rows.copy() if self.snapshot is None else self.snapshot
            self.writer.start(lambda: self._written(checkpoint.write(
                self.writer.comm, self.directory, step, rows, t, self.layout, extra, self.identity.train.keep_last,
                protect, self.hooks), judged), self.hooks, step)
            man = {"path": os.path.join(self.directory, files.final_name(step)), "step": step}
        self.last_judged = man["path"] if judged else self.last_judged
        self.cadence.saved()
        return {**man, "judged": judged}

    def remember(self, state: RunState, shard: ShardState) -> None:
        """Collective. Keep `state` in the nodes' memory (every K-th step of --memory-tier K; else nothing)."""
        if (every := self.identity.train.memory_tier) and state.step % every == 0:
            self.tier = self.tier or tier.MemoryTier(self.comm, state.run_id, every, self.layout.shard, state.step)
            self.tier.keep(state.step, self.view.to_stored(shard), {**self.extra(state), "judged": False})

    def forget(self) -> None:
        """At the end of a run whose last state is on disk: the memory tier's copies completed, the tier removed."""
        if self.tier is not None:
            self.tier.close()

    def save_best(self, state: RunState, shard: ShardState, directory: str) -> dict:
        """Collective. Write `state` (a new best held-out loss) into `directory`, a folder of its own
        that keeps only it, synchronously (capstone.checkpoint.best); returns its manifest."""
        self.drain()   # one parallel-HDF5 file at a time (capstone.checkpoint.background)
        extra = {**self.extra(state), "best": {"held_out": state.best_eval, "step": state.step}}
        return checkpoint.save(self.comm, directory, state.step, self.view.to_stored(shard), self.layout, extra,
                               keep_last=1, hooks=self.hooks)

    def _written(self, man: dict, judged: bool) -> dict:
        man["judged"] = judged
        self.manifests.append(man)
        return man

    def writing(self) -> bool:
        """Whether this rank's background write is still running (the ranks agree on it every step)."""
        return self.writer is not None and self.writer.running()

    def drain(self) -> None:
        """Wait for the checkpoint being written in the background, if any (collective: every rank
        has the same writes in flight); raises its CheckpointError."""
        if self.writer is not None:
            self.writer.wait()

    def holds(self, path: str | None, step: int) -> bool:
        """Whether `path` (the checkpoint this run resumed from) is this run's checkpoint of `step`."""
        return path is not None and os.path.abspath(path) == os.path.abspath(
            os.path.join(self.directory, files.final_name(step)))

    def load(self, path) -> tuple[ShardState, RunState, dict]:
        """Collective. Load `path` (any world size or grid; a recover.Found: from the nodes' memory), refusing
        another model or data stream."""
        stored, meta = (path.load(self.comm, self.layout) if isinstance(path, recover.Found) else
                        checkpoint.load(self.comm, path, self.layout, self.identity.must_match()))
        return self.view.from_stored(stored), RunState.from_json(meta["run"]), meta

    def verify_first(self) -> dict | None:
        """Collective. Reload the run's first checkpoint and compare it with its snapshot (d)."""
        self.drain()
        if not self.manifests:
            return None
        return checkpoint.verify_snapshot(self.comm, self.manifests[0]["path"], self.layout,
                                          self.identity.must_match(), self.snapshot)
