"""Checkpoints of a model-parallel run in the canonical 1-rank layout (imported when --tp or --pp > 1).

A rank of a replica's model-parallel group (pipeline stage p, tensor-parallel rank t: mp rank
p * tp + t) holds a part of the model: its stage's parameter groups, each sliced by tensor
parallelism (capstone.parallel.tensor.positions maps its elements to the 1-rank buffer).
Checkpoints hold the canonical 1-rank vectors sharded over the world ranks (the file format of any
data-parallel run), so they restore on any grid: `Canonical` converts this rank's optimizer shard
to and from that on save and load, and assembles the whole model for fingerprints.
"""

import numpy as np

from capstone.model.params import DTYPE, Layout
from capstone.parallel import tensor
from capstone.parallel.grid import allgathered
from capstone.step.state import ShardState


class Canonical:
    """Converts this rank's optimizer shard (of its part, sharded over its data-parallel group) to
    and from its shard of the canonical 1-rank vectors over the world."""

    def __init__(self, grid, cfg, layout: Layout, full_layout: Layout, stage_groups: list[tuple]):
        """`stage_groups[p]`: the parameter groups of pipeline stage p (one entry: the whole model)."""
        self.grid, self.layout, self.full, self.cfg = grid, layout, full_layout, cfg
        self.parts = [(groups, t) for groups in stage_groups for t in range(grid.tp.size)]   # by mp rank
        self.width = max(Layout.for_model(cfg, 1, grid.tp.size, g).n_params for g, _ in self.parts)   # the largest

    def _map(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Part m's `tensor.positions`, made when asked (8 bytes an element: not held through the run)."""
        groups, t = self.parts[m]
        return tensor.positions(self.cfg, self.grid.tp.size, t, groups)

    def _assemble(self, rows: np.ndarray) -> np.ndarray:
        """Collective over the model-parallel group: (k, full.padded) canonical rows from every
        part's (k, n) rows."""
        mine = np.pad(rows, ((0, 0), (0, self.width - rows.shape[1])))
        parts = allgathered(self.grid.mp, mine, "checkpoint: allgather of the model-parallel parts")
        full = np.zeros((len(rows), self.full.padded), dtype=DTYPE)
        for m in range(len(self.parts)):
            idx, owned = self._map(m)
            full[:, idx[owned]] = parts[m][:, :len(idx)][:, owned]
        return full

    def to_stored(self, shard: ShardState) -> ShardState:
        """Collective. This rank's world shard of the full master/m/v (one at a time: a third of the memory)."""
        g, n = self.grid, self.layout.n_params
        (lo, hi), out = self.full.shard_range(g.world.rank), []
        for row in shard.rows():
            got = allgathered(g.dp, row, "checkpoint: allgather of the optimizer shards")
            out.append(self._assemble(got.reshape(1, -1)[:, :n])[0, lo:hi].copy())
        return ShardState(*out, t=shard.t)

    def from_stored(self, shard: ShardState) -> ShardState:
        """Collective. This rank's (part, data-parallel shard) state from its world shard (one array at a time)."""
        g, sl = self.grid, self.layout
        idx, (lo, hi), out = self._map(g.mp.rank)[0], sl.shard_range(g.dp.rank), []
        for row in shard.rows():
            got = allgathered(g.world, row, "checkpoint: allgather of the stored shards")
            out.append(np.pad(got.reshape(-1)[idx], (0, sl.padded - sl.n_params))[lo:hi].copy())
        return ShardState(*out, t=shard.t)

    def whole(self, params: np.ndarray) -> np.ndarray:
        """Collective over the model-parallel group: the full 1-rank parameter vector (unpadded)."""
        return self._assemble(params[None, :self.layout.n_params])[0, :self.full.n_params]

    def describe(self) -> dict:
        return {"model_parallel": {**self.grid.describe(), "stored": "canonical 1-rank layout, sharded over "
                                   "the world ranks; re-sliced on load"}}
