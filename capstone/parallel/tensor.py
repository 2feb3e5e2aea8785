"""Tensor parallelism's bookkeeping (imported only when --tp > 1; the split itself is the fused
block's, capstone.model.blocks): which elements of the whole model a rank holds, and the
conversion between that and the canonical 1-rank layout of checkpoints.

A tensor-parallel rank t of K holds, in the names and order of `param_shapes`, its part of each
parameter as capstone.model.params.TP_PLAN splits it: c_attn by whole heads [t*H/K, (t+1)*H/K)
(its fused weight (C, 3C/K) is [q_t | k_t | v_t], the columns h*D..(h+1)*D of each of q, k, v),
mlp.c_fc by columns, the two c_proj weights by rows; everything else whole.
`positions` maps each element of a rank's flat buffer (of a pipeline stage's groups, if any) to its
index in the 1-rank buffer; a model-parallel run starts from exactly the 1-rank run's parameters
(`initial_params`), and its checkpoints are converted to the canonical 1-rank layout by
capstone.parallel.canonical.
"""

import math

import numpy as np

from capstone.model.fingerprint import sum_squares
from capstone.model.params import Layout, group_of, init_params, is_split, tp_split


def _slice(a: np.ndarray, name: str, K: int, t: int) -> np.ndarray:
    """Tensor-parallel rank t's part of the whole array a of parameter `name` (params.TP_PLAN)."""
    split = tp_split(name)
    if split == "heads":                                    # heads t*H/K.. of each of q, k, v
        return a.reshape(*a.shape[:-1], 3, K, -1)[..., t, :].reshape(*a.shape[:-1], -1)
    return a if split is None else np.split(a, K, axis=0 if split == "rows" else -1)[t]


def positions(cfg, K: int, t: int, groups: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(idx, owned) for tensor-parallel rank t (of the parameter `groups` of a pipeline stage, None:
    all): idx[i] is the position in the 1-rank buffer of element i of the rank's buffer; owned[i]
    is False for whole (replicated) elements on t > 0."""
    idx, owned = [], []
    for name, shape, offset in Layout.for_model(cfg, 1).entries:    # offsets in the 1-rank buffer
        if groups is None or group_of(name) in groups:
            part = _slice(np.arange(offset, offset + math.prod(shape), dtype=np.int64).reshape(shape), name, K, t)
            idx.append(part.ravel())
            owned.append(np.full(part.size, part.size < math.prod(shape) or t == 0))
    return np.concatenate(idx), np.concatenate(owned)


def initial_params(cfg, layout: Layout, seed: int, K: int, t: int, groups: tuple | None = None) -> np.ndarray:
    """This rank's part (tensor-parallel rank t, pipeline stage `groups`) of the 1-rank run's initial
    parameters (`init_params`), in `layout` (of those groups)."""
    return init_params(layout, cfg, seed, lambda name, whole: _slice(whole, name, K, t))


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
    return sum(sum_squares(view.reshape(-1)) for name, view in layout.views(params).items()
               if is_split(name) or tp_rank == 0)
