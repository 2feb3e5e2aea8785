"""Tensor parallelism's bookkeeping (imported only when --tp > 1; the split itself is the fused
block's, capstone.model.blocks): which elements of the whole model a rank holds, and the
conversion between that and the canonical 1-rank layout of checkpoints.

A tensor-parallel rank t of K holds, in the names and order of `param_shapes`:
  attn.c_attn   column-parallel by whole heads: heads [t*H/K, (t+1)*H/K); its fused weight
                (C, 3C/K) is [q_t | k_t | v_t], the columns h*D..(h+1)*D of each of q, k, v
  attn.c_proj   row-parallel: the C/K rows of the owned heads; its bias is whole
  mlp.c_fc      column-parallel: (C, 4C/K) and bias (4C/K,)
  mlp.c_proj    row-parallel: (4C/K, C); its bias is whole
  everything else (embeddings, LayerNorms, LM head, row-parallel biases) whole.
`positions` maps each element of a rank's flat buffer to its index in the 1-rank buffer; a
tensor-parallel run starts from exactly the 1-rank run's parameters (`initial_params`).
Checkpoints hold the canonical 1-rank vectors sharded over the world ranks (the file format of any
data-parallel run), so they restore on any grid: `Canonical` converts on save and load.
"""

from __future__ import annotations

import math

import numpy as np

from capstone.model.fingerprint import sum_squares
from capstone.model.params import DTYPE, Layout, init_params, is_split, param_shapes
from capstone.parallel.zero import ShardState


def _slice(a: np.ndarray, name: str, K: int, t: int) -> np.ndarray:
    """Tensor-parallel rank t's part of the whole array a of parameter `name`."""
    if name.endswith(("attn.c_proj.w", "mlp.c_proj.w")):                   # rows
        n = a.shape[0] // K
        return a[t * n:(t + 1) * n]
    if name.endswith(("mlp.c_fc.w", "mlp.c_fc.b")):                         # columns
        n = a.shape[-1] // K
        return a[..., t * n:(t + 1) * n]
    if name.endswith(("attn.c_attn.w", "attn.c_attn.b")):                   # heads t*H/K.. of q, k, v
        C = a.shape[-1] // 3
        n = C // K
        return a[..., np.concatenate([j * C + t * n + np.arange(n) for j in range(3)])]
    return a


def positions(cfg, K: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(idx, owned) for tensor-parallel rank t: idx[i] is the position in the 1-rank buffer of
    element i of the rank's buffer; owned[i] is False for whole (replicated) elements on t > 0."""
    idx, owned, offset = [], [], 0
    for name, shape in param_shapes(cfg):
        part = _slice(np.arange(offset, offset + math.prod(shape), dtype=np.int64).reshape(shape), name, K, t)
        idx.append(part.ravel())
        owned.append(np.full(part.size, part.size < math.prod(shape) or t == 0))
        offset += math.prod(shape)
    return np.concatenate(idx), np.concatenate(owned)


def initial_params(cfg, layout: Layout, seed: int, K: int, t: int) -> np.ndarray:
    """Rank t's part of the 1-rank run's initial parameters (`init_params`), in `layout`."""
    full = init_params(Layout.for_model(cfg, 1), cfg, seed)
    out = layout.zeros()
    out[:layout.n_params] = full[positions(cfg, K, t)[0]]
    return out


def norm_weight(layout: Layout, tp_rank: int, lo: int, hi: int) -> np.ndarray:
    """Per element of the shard [lo, hi) of a rank's buffer: 1 where it counts the parameter in the
    gradient norm, 0 for a whole (replicated) parameter, which tp rank 0 counts alone."""
    weight = np.zeros(layout.padded)
    for name, shape, off in layout.entries:
        weight[off:off + math.prod(shape)] = 1.0 if is_split(name) or tp_rank == 0 else 0.0
    return weight[lo:hi]


def owned_sumsq(layout: Layout, params: np.ndarray, tp_rank: int) -> float:
    """The sum of squares of the parameters this rank counts for its replica: its split ones, and
    the whole ones on tp rank 0 only."""
    views = layout.views(params)
    return sum(sum_squares(views[name].reshape(-1)) for name, _, _ in layout.entries
               if is_split(name) or tp_rank == 0)


class Canonical:
    """Converts this rank's optimizer shard (of its tensor-parallel slice, sharded over its
    data-parallel group) to and from its shard of the canonical 1-rank vectors over the world."""

    def __init__(self, grid, cfg, layout: Layout, full_layout: Layout):
        self.grid, self.layout, self.full = grid, layout, full_layout
        self.maps = [positions(cfg, grid.tp.size, t) for t in range(grid.tp.size)]

    def to_stored(self, shard: ShardState) -> ShardState:
        """Collective. This rank's world shard of the full master/m/v."""
        g, n = self.grid, self.layout.n_params
        rows = np.ascontiguousarray(np.stack(shard.rows()))                    # (3, dp shard)
        got = np.empty((g.dp.size,) + rows.shape, dtype=DTYPE)
        g.dp.Allgather(got, "checkpoint: allgather of the optimizer shards", send=rows)
        mine = np.ascontiguousarray(got.transpose(1, 0, 2).reshape(3, -1)[:, :n])
        slices = np.empty((g.tp.size,) + mine.shape, dtype=DTYPE)
        g.tp.Allgather(slices, "checkpoint: allgather of the tensor-parallel slices", send=mine)
        full = np.zeros((3, self.full.padded), dtype=DTYPE)
        for t, (idx, owned) in enumerate(self.maps):
            full[:, idx[owned]] = slices[t][:, owned]
        lo, hi = self.full.shard_range(g.world.rank)
        return ShardState(*(full[i, lo:hi].copy() for i in range(3)), t=shard.t)

    def from_stored(self, shard: ShardState) -> ShardState:
        """Collective. This rank's (slice, data-parallel shard) state from its world shard."""
        g, sl = self.grid, self.layout
        rows = np.ascontiguousarray(np.stack(shard.rows()))
        got = np.empty((g.world.size,) + rows.shape, dtype=DTYPE)
        g.world.Allgather(got, "checkpoint: allgather of the stored shards", send=rows)
        full = got.transpose(1, 0, 2).reshape(3, -1)
        mine = np.zeros((3, sl.padded), dtype=DTYPE)
        mine[:, :sl.n_params] = full[:, self.maps[g.tp.rank][0]]
        lo, hi = sl.shard_range(g.dp.rank)
        return ShardState(*(mine[i, lo:hi].copy() for i in range(3)), t=shard.t)

    def whole(self, params: np.ndarray) -> np.ndarray:
        """Collective over the tensor-parallel group: the full 1-rank parameter vector (unpadded)."""
        g, n = self.grid, self.layout.n_params
        slices = np.empty((g.tp.size, n), dtype=DTYPE)
        g.tp.Allgather(slices, "allgather of the tensor-parallel slices", send=np.ascontiguousarray(params[:n]))
        full = np.zeros(self.full.n_params, dtype=DTYPE)
        for t, (idx, owned) in enumerate(self.maps):
            full[idx[owned]] = slices[t][owned]
        return full

    def describe(self) -> dict:
        return {"tensor_parallel": {**self.grid.describe(), "stored": "canonical 1-rank layout, sharded over "
                                    "the world ranks; re-sliced on load"}}
