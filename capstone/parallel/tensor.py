"""Megatron-style tensor parallelism (--tp K) on top of ZeRO-1 data parallelism.

Within a TP group (K ranks of one replica, see `grid`):
  attn.c_attn   column-parallel by whole heads: rank t owns heads [t*H/K, (t+1)*H/K); its fused
                weight (C, 3C/K) is [q_t | k_t | v_t], the columns h*D..(h+1)*D of each of q, k, v
  attn.c_proj   row-parallel: the C/K rows of the owned heads; its bias is replicated
  mlp.c_fc      column-parallel: (C, 4C/K) and bias (4C/K,)
  mlp.c_proj    row-parallel: (4C/K, C); its bias is replicated
  everything else (embeddings, LayerNorms, LM head, row-parallel biases) replicated.
Per block: x -> f -> column-parallel -> (attention / GELU) -> row-parallel (no bias) -> g -> + bias,
with the conjugate ops f (identity forward, Allreduce over the TP group backward) and g
(Allreduce forward, identity backward) as autograd primitives.

Gradients: a replicated parameter's input is identical on every TP rank (it comes after a g, or
is the embedding input), and the gradient reaching it is identical too (f's backward sums the
partial input gradients), so every TP rank computes the same full gradient for it: the DP
reduce-scatter alone finishes it; nothing is summed over TP. The global gradient norm counts
every parameter once: split parameters on every TP rank, replicated ones on TP rank 0 only.

Each TP rank's parameters live in a flat buffer of the TP-slice `Layout` (same names, sliced
shapes), initialised by slicing the full `init_params` (same seed), so a TP-K run starts from
exactly the 1-rank parameters. ZeRO-1 shards that slice over the DP group (`TPZeroAdam`).
Checkpoints are grid-independent: `TPCheckpointer` converts the (TP slice, DP shard) state to
the canonical 1-rank layout sharded over the N world ranks (the usual file format), and back.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
from autograd.extend import defvjp, primitive
from mpi4py import MPI

from capstone.model.backward import value_and_grad_into
from capstone.checkpoint.saver import Checkpointer
from capstone.config import ModelConfig
from capstone.data.heldout import HeldOut
from capstone.model.kernels import causal_attention, cross_entropy_sum, embed, layer_norm, linear, linear_gelu
from capstone.model.gpt import Model
from capstone.model.params import DTYPE, Layout, init_params, param_shapes, sum_squares
from capstone.parallel.zero import GradStats, ShardState, ZeroAdam

@dataclass
class TPComm:
    """The f/g allreduces of one forward+backward over a TP group of `ranks`: wall seconds, bytes
    summed (S of each), calls."""

    ranks: int = 1
    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0


TP_COMM = TPComm()   # since the last reset, in TPModel.forward_backward


# ---- the conjugate communication ops -----------------------------------------------------------

def _allreduce(x, comm):
    """Sum of x over `comm` (a fresh contiguous array; x untouched)."""
    out = np.array(x, copy=True, order="C")
    if comm.Get_size() > 1:
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM)
        TP_COMM.seconds += time.perf_counter() - t0
        TP_COMM.bytes += out.nbytes
        TP_COMM.calls += 1
    return out


@primitive
def copy_to_tp(x, comm):
    """f: identity forward; backward sums the gradient over the TP group."""
    return x


@primitive
def reduce_from_tp(x, comm):
    """g: sum over the TP group forward; identity backward."""
    return _allreduce(x, comm)


defvjp(copy_to_tp, lambda ans, x, comm: lambda g: _allreduce(g, comm), None)
defvjp(reduce_from_tp, lambda ans, x, comm: lambda g: g, None)


# ---- the TP-slice layout and its map into the full layout --------------------------------------

def _split_kind(name: str) -> str | None:
    """How parameter `name` is split over the TP group: 'qkv', 'cols', 'rows' or None (replicated)."""
    if name.endswith("attn.c_attn.w") or name.endswith("attn.c_attn.b"):
        return "qkv"
    if name.endswith("mlp.c_fc.w") or name.endswith("mlp.c_fc.b"):
        return "cols"
    if name.endswith("attn.c_proj.w") or name.endswith("mlp.c_proj.w"):
        return "rows"
    return None


def _slice(a: np.ndarray, kind: str | None, K: int, t: int) -> np.ndarray:
    """TP rank t's part of the full array a (any array of the parameter's full shape)."""
    if kind is None:
        return a
    if kind == "rows":
        n = a.shape[0] // K
        return a[t * n:(t + 1) * n]
    if kind == "cols":
        n = a.shape[-1] // K
        return a[..., t * n:(t + 1) * n]
    C = a.shape[-1] // 3                                   # qkv: heads t*H/K.. of each of q, k, v
    n = C // K
    cols = np.concatenate([j * C + t * n + np.arange(n) for j in range(3)])
    return a[..., cols]


def tp_layout(cfg: ModelConfig, K: int, dp: int) -> Layout:
    """The TP slice's layout: the names of `param_shapes`, sliced shapes, padded for `dp` ranks."""
    entries, offset = [], 0
    for name, shape in param_shapes(cfg):
        sliced = _slice(np.empty(shape, dtype=np.bool_), _split_kind(name), K, 0).shape
        entries.append((name, tuple(sliced), offset))
        offset += math.prod(sliced)
    return Layout(tuple(entries), offset, dp)


def positions(cfg: ModelConfig, K: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(idx, owned) for TP rank t: idx[i] is the position in the full (1-rank) buffer of element i
    of the slice buffer; owned[i] is False for replicated elements on t > 0 (counted on t = 0)."""
    full = Layout.for_model(cfg, 1)
    idx, owned = [], []
    for name, shape, off in full.entries:
        kind = _split_kind(name)
        part = _slice(np.arange(off, off + math.prod(shape), dtype=np.int64).reshape(shape), kind, K, t).ravel()
        idx.append(part)
        owned.append(np.full(part.size, kind is not None or t == 0))
    return np.concatenate(idx), np.concatenate(owned)


def slice_params(full: np.ndarray, layout: Layout, idx: np.ndarray) -> np.ndarray:
    """A slice buffer of `layout` filled from a full flat buffer."""
    out = layout.zeros()
    out[:layout.n_params] = full[idx]
    return out


# ---- the model -----------------------------------------------------------------------------------

def _tp_attention(x, p, h, T, Hk, comm, zeros):
    qkv = linear(copy_to_tp(x, comm), p[h + "attn.c_attn.w"], p[h + "attn.c_attn.b"])   # (B*T, 3C/K)
    y = causal_attention(qkv, T, Hk)                                                     # (B*T, C/K)
    return reduce_from_tp(linear(y, p[h + "attn.c_proj.w"], zeros), comm) + p[h + "attn.c_proj.b"]


def _tp_mlp(x, p, h, comm, zeros):
    u = linear_gelu(copy_to_tp(x, comm), p[h + "mlp.c_fc.w"], p[h + "mlp.c_fc.b"])       # (B*T, 4C/K)
    return reduce_from_tp(linear(u, p[h + "mlp.c_proj.w"], zeros), comm) + p[h + "mlp.c_proj.b"]


def tp_loss_sum(p, idx, targets, cfg: ModelConfig, scale: float, comm, K: int):
    """model.loss_sum with the blocks split over the TP group `comm` of K ranks (same value on each)."""
    T = idx.shape[1]
    zeros = np.zeros(cfg.d_model, dtype=p["wte"].dtype if hasattr(p["wte"], "dtype") else DTYPE)
    x = embed(p["wte"], p["wpe"], idx)
    for i in range(cfg.n_layers):
        h = f"h{i}."
        x = x + _tp_attention(layer_norm(x, p[h + "ln_1.w"], p[h + "ln_1.b"]), p, h, T, cfg.n_heads // K, comm, zeros)
        x = x + _tp_mlp(layer_norm(x, p[h + "ln_2.w"], p[h + "ln_2.b"]), p, h, comm, zeros)
    z = linear(layer_norm(x, p["ln_f.w"], p["ln_f.b"]), p["lm_head.w"], p["lm_head.b"])
    return cross_entropy_sum(z, targets.reshape(-1)) * scale


class TPModel(Model):
    """`Model` over a TP slice buffer; forward and backward are collective over the TP group."""

    def __init__(self, cfg: ModelConfig, layout: Layout, params: np.ndarray, grid):
        super().__init__(cfg, layout, params)
        self.grid = grid
        self.tp_comm = TPComm(grid.tp)   # the f/g allreduces of the last forward+backward

    def forward_backward(self, batches, scale: float) -> float:
        self.grads.fill(0.0)
        TP_COMM.ranks, TP_COMM.seconds, TP_COMM.bytes, TP_COMM.calls = self.grid.tp, 0.0, 0, 0
        args = (self.cfg, scale, self.grid.tp_comm, self.grid.tp)
        loss = sum(value_and_grad_into(tp_loss_sum, self.p, self.g, x, y, *args) for x, y in batches)
        self.tp_comm = dataclasses.replace(TP_COMM)
        return loss

    def loss(self, x: np.ndarray, y: np.ndarray, scale: float) -> float:
        return float(tp_loss_sum(self.p, x, y, self.cfg, scale, self.grid.tp_comm, self.grid.tp))

    def whole(self) -> np.ndarray:
        """Collective over the TP group: the full parameters in the 1-rank layout (unpadded)."""
        return full_params(self.grid, self.layout, self.cfg, self.params)


class TPHeldOut(HeldOut):
    """Held-out rows split over the DP group; every TP rank runs the (collective) forward, TP rank 0's
    share alone counts, so the world sum of `loss_share` is the mean loss per token."""

    def __init__(self, data, batches, batch_size, seq_len, grid):
        super().__init__(data, batches, batch_size, seq_len, grid.dp_rank, grid.dp)
        self.count = grid.tp_rank == 0

    def loss_share(self, model) -> float:
        share = super().loss_share(model)
        return share if self.count else 0.0


# ---- ZeRO-1 over the DP group --------------------------------------------------------------------

class TPZeroAdam(ZeroAdam):
    """ZeroAdam over the DP group for this TP slice; the gradient norm and the extras are global."""

    def __init__(self, grid, layout: Layout, params, grads, owned: np.ndarray, *args, **kw):
        super().__init__(grid.dp_comm, layout, params, grads, *args, **kw)
        self.grid = grid
        weight = np.zeros(layout.padded)
        weight[:layout.n_params] = owned
        self.norm_weight = weight[self.lo:self.hi]

    def reduce_gradients(self, extras=()) -> GradStats:
        """Collective over the world. The DP reduce-scatter (ZeroAdam's), then one world Allreduce
        of [owned sum of squares, *extras]: every parameter counted once in the norm; the extras
        (identical on the K TP ranks of a replica, e.g. the loss) divided by K."""
        super().reduce_gradients()
        small = np.array([sum_squares(self.g_shard, self.norm_weight), *extras], dtype=np.float64)
        self.grid.world_comm.Allreduce(MPI.IN_PLACE, small, op=MPI.SUM)
        return GradStats(float(np.sqrt(small[0])), small[1:] / self.grid.tp)


# ---- checkpoints: canonical (1-rank layout) on disk ----------------------------------------------

class TPCheckpointer(Checkpointer):
    """Checkpointer whose files hold the canonical full vectors sharded over the world (the file
    format of any data-parallel run), so they restore on any grid; converts on save and load."""

    def __init__(self, dist, directory, full_layout: Layout, identity, grid, layout: Layout, cfg: ModelConfig):
        super().__init__(dist, directory, full_layout, identity)
        self.grid, self.slice_layout = grid, layout
        self.maps = [positions(cfg, grid.tp, t) for t in range(grid.tp)]

    def to_stored(self, shard: ShardState) -> ShardState:
        """Collective. This rank's world shard of the full master/m/v from the (slice, DP shard) states."""
        g, sl = self.grid, self.slice_layout
        rows = np.ascontiguousarray(np.stack(shard.rows()))                    # (3, dp shard)
        got = np.empty((g.dp,) + rows.shape, dtype=DTYPE)
        g.dp_comm.Allgather(rows, got)
        mine = np.ascontiguousarray(got.transpose(1, 0, 2).reshape(3, -1)[:, :sl.n_params])
        slices = np.empty((g.tp,) + mine.shape, dtype=DTYPE)
        g.tp_comm.Allgather(mine, slices)
        full = np.zeros((3, self.layout.padded), dtype=DTYPE)
        for t, (idx, owned) in enumerate(self.maps):
            full[:, idx[owned]] = slices[t][:, owned]
        lo, hi = self.layout.shard_range(g.rank)
        return ShardState(*(full[i, lo:hi].copy() for i in range(3)), t=shard.t)

    def from_stored(self, shard: ShardState) -> ShardState:
        """Collective. This rank's (slice, DP shard) state from its world shard of the full vectors."""
        g, sl = self.grid, self.slice_layout
        rows = np.ascontiguousarray(np.stack(shard.rows()))
        got = np.empty((g.tp * g.dp,) + rows.shape, dtype=DTYPE)
        g.world_comm.Allgather(rows, got)
        full = got.transpose(1, 0, 2).reshape(3, -1)
        mine = np.zeros((3, sl.padded), dtype=DTYPE)
        mine[:, :sl.n_params] = full[:, self.maps[g.tp_rank][0]]
        lo, hi = sl.shard_range(g.dp_rank)
        return ShardState(*(mine[i, lo:hi].copy() for i in range(3)), t=shard.t)

    def extra(self) -> dict:
        return {"tensor_parallel": {**self.grid.describe(), "stored": "canonical 1-rank layout, sharded over "
                                    "the world ranks; re-sliced on load"}}


# ---- wiring (called by run.build when --tp > 1) --------------------------------------------------

def build_parts(dist, grid, mcfg, tcfg, data, identity, ckpt_dir):
    """(layout, model, opt, heldout, ckpt) of this rank's TP slice."""
    layout = tp_layout(mcfg, grid.tp, grid.dp)
    idx, owned = positions(mcfg, grid.tp, grid.tp_rank)
    full_layout = Layout.for_model(mcfg, grid.tp * grid.dp)
    params = (slice_params(init_params(full_layout, mcfg, tcfg.seed), layout, idx) if grid.dp_rank == 0
              else layout.zeros())
    model = TPModel(mcfg, layout, params, grid)
    opt = TPZeroAdam(grid, layout, model.params, model.grads, owned, (tcfg.beta1, tcfg.beta2), tcfg.eps,
                     tcfg.weight_decay)
    heldout = TPHeldOut(data, tcfg.eval_batches, tcfg.eval_batch_size, mcfg.seq_len, grid)
    ckpt = TPCheckpointer(dist, ckpt_dir, full_layout, identity, grid, layout, mcfg)
    return layout, model, opt, heldout, ckpt


def full_params(grid, layout: Layout, cfg: ModelConfig, params: np.ndarray) -> np.ndarray:
    """Collective over the TP group: the full 1-rank parameter vector (unpadded) assembled from the slices."""
    slices = np.empty((grid.tp, layout.n_params), dtype=DTYPE)
    grid.tp_comm.Allgather(np.ascontiguousarray(params[:layout.n_params]), slices)
    full = np.zeros(Layout.for_model(cfg, 1).n_params, dtype=DTYPE)
    for t in range(grid.tp):
        idx, owned = positions(cfg, grid.tp, t)
        full[idx[owned]] = slices[t][owned]
    return full
