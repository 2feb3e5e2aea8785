"""ZeRO-3: the parameters are sharded too. A rank keeps its shard of the flat parameter buffer
(what ZeroAdam updates); a layer's group is allgathered from the data-parallel shards just before
its forward and freed after it, gathered again for its backward, and the next group's gather is
started while the current one computes (prefetch, driven by capstone.parallel.progress's thread).

The layers are the model's own (capstone.model.blocks), wrapped: a group's array is not an input of
the autograd graph (the graph would keep every gathered block alive until its backward), but is
fetched by name from the `Gatherer` inside each layer's forward and backward; the layer's
parameter gradient goes straight to the ZeRO-2 reducer (capstone.parallel.zero2), and autograd
carries only the activations' gradients (the embedding hangs on the scalar `anchor`).
Each gathered group is fingerprinted once a step: invariant (b), where no two ranks hold the same
shard, compares what they do share, the groups they assembled (capstone.parallel.replicas).
"""

from __future__ import annotations

import hashlib

import numpy as np
from autograd import make_vjp
from autograd.extend import vspace

from capstone.model import blocks, gpt
from capstone.model import kernels as K
from capstone.model.backward import training_pass
from capstone.model.fingerprint import sum_squares, word_sum
from capstone.model.params import DTYPE, Layout
from capstone.parallel.progress import Progress
from capstone.parallel.zero import ZeroAdam
from capstone.parallel.zero2 import GroupPlan


class ShardedAdam(ZeroAdam):
    """ZeroAdam over a parameter shard: `params` is this rank's shard alone (each rank made its own,
    capstone.run), and an update is not allgathered: the layers gather what they need."""

    def _adopt(self, params: np.ndarray) -> np.ndarray:
        if params.dtype != DTYPE or params.shape != (self.layout.shard,) or not params.flags.c_contiguous:
            raise ValueError(f"params must be a contiguous float32 shard of length {self.layout.shard}")
        return params.copy()

    def _publish(self) -> None:
        self.params[...] = self.state.master


class Gatherer:
    """Gathers parameter groups from the data-parallel shards on demand, one group ahead."""

    def __init__(self, dp, layout: Layout, shard: np.ndarray, cfg, progress: Progress):
        self.dp, self.layout, self.shard, self.progress = dp, layout, shard, progress
        self.plans = {g: GroupPlan(a, b, layout, dp.rank) for g, (a, b) in layout.group_ranges().items()}
        self.order = ["embed"] + [f"h{i}" for i in range(cfg.n_layers)] + ["head"]
        self.order = [g for g in self.order if g in self.plans]
        self.live, self.forward = {}, True
        self.reducer, self.peak, self.digests = None, 0, {}

    def reset(self) -> None:
        """A new step: the fingerprints start again (`peak` is the run's)."""
        self.digests = {}

    def bound(self) -> int:
        """The formula for `peak`: the largest two consecutive groups (one computing, the next in flight)."""
        sizes = [4 * (self.plans[g].b - self.plans[g].a) for g in self.order]
        return max([sizes[0]] + [x + y for x, y in zip(sizes, sizes[1:])])

    def _start(self, name: str) -> None:
        plan = self.plans[name]
        full = np.empty(plan.b - plan.a, dtype=DTYPE)
        mine = np.ascontiguousarray(self.shard[plan.recv])
        if self.dp.size > 1:
            ticket = self.progress.submit(self.dp.Iallgatherv(mine, full, plan.counts), mine)
        else:
            full[...], ticket = mine, None
        self.live[name] = (full, ticket)
        self.peak = max(self.peak, sum(a.nbytes for a, _ in self.live.values()))

    def gather(self, name: str) -> np.ndarray:
        """Group `name`'s full array (waiting for its gather), and the next group's gather started."""
        if name not in self.live:
            self._start(name)
        full, ticket = self.live[name]
        if ticket is not None:
            waited = Progress.wait(ticket, self.dp.deadline, f"allgather of the parameters of {name} (ZeRO-3)")
            self.dp.count("allgather_params", "allgatherv", full.nbytes, waited, 1,
                          max(0.0, ticket.completed - ticket.started - waited))
            self.live[name] = (full, None)
        i = self.order.index(name) + (1 if self.forward else -1)
        if 0 <= i < len(self.order) and self.order[i] not in self.live:
            self._start(self.order[i])
        if name not in self.digests:
            self.digests[name] = word_sum(full)
        return full

    def release(self, name: str) -> None:
        self.live.pop(name, None)

    def digest(self) -> str:
        """16 hex digits of the groups gathered this step (the same on every rank of the group)."""
        text = ",".join(f"{g}:{self.digests[g]:x}" for g in sorted(self.digests))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- the model's layers, their parameters fetched by name -----------------------------------------

def _embedding_fwd(anchor, gat, idx, shapes):
    out = blocks._embedding_fwd(gat.gather("embed"), idx, shapes)[0]
    gat.release("embed")
    return out, None


def _embedding_bwd(g, saved, argnums, anchor, gat, idx, shapes):
    w = gat.gather("embed")
    gat.reducer.reduce_group("embed", blocks._embedding_bwd(g, None, (0,), w, idx, shapes)[0])
    gat.release("embed")
    return {0: np.zeros((), dtype=np.float64)}


def _block_fwd(x, gat, name, T, H, shapes, tp, recompute):
    out, saved = blocks._block_fwd(x, gat.gather(name), T, H, shapes, tp)
    gat.release(name)
    return out, None if recompute else saved


def _block_bwd(g, saved, argnums, x, gat, name, T, H, shapes, tp, recompute):
    w = gat.gather(name)
    if saved is None:   # --recompute: the activations again, from the block's input
        saved = blocks._block_fwd(x, w, T, H, shapes, tp)[1]
    d = blocks._block_bwd(g, saved, (0, 1), x, w, T, H, shapes, tp)
    gat.reducer.reduce_group(name, d[1])
    gat.release(name)
    return {0: d[0]}


def _head_fwd(x, gat, targets, shapes):
    loss, saved = blocks._head_loss_fwd(x, gat.gather("head"), targets, shapes)
    gat.release("head")
    return loss, saved


def _head_bwd(g, saved, argnums, x, gat, targets, shapes):
    w = gat.gather("head")
    d = blocks._head_loss_bwd(g, saved, (0, 1), x, w, targets, shapes)
    gat.reducer.reduce_group("head", d[1])
    gat.release("head")
    return {0: d[0]}


embedding = K.define("sharded_embedding", _embedding_fwd, _embedding_bwd)
block = K.define("sharded_block", _block_fwd, _block_bwd)
head_loss = K.define("sharded_head_loss", _head_fwd, _head_bwd)


def loss_sum(gat, anchor, idx, targets, cfg, scale, tp, recompute: bool):
    """capstone.model.gpt.loss_sum with these layers: the groups are named, not passed (see the module)."""
    return gpt.loss_sum({g: g for g in gat.order}, idx, targets, cfg, scale, tp,
                        layer=lambda x, name, *rest: block(x, gat, name, *rest, recompute),
                        embed=lambda name, idx_, shapes: embedding(anchor, gat, idx_, shapes),
                        head=lambda x, name, targets_, shapes: head_loss(x, gat, targets_, shapes))


class ShardedModel:
    """The Model interface (capstone.model.gpt) over this rank's parameter shard."""

    def __init__(self, cfg, layout: Layout, shard: np.ndarray, grid, recompute: bool, reducer):
        self.cfg, self.layout, self.tp, self.recompute = cfg, layout, grid.tp, recompute
        self.params, self.grads, self.dp = shard, None, grid.dp
        self.gatherer = Gatherer(grid.dp, layout, shard, cfg, reducer.progress)
        self.gatherer.reducer = reducer

    def micro_batch(self, x, y, scale: float, fresh: bool) -> float:
        gat = self.gatherer
        gat.forward = True
        vjp, value = make_vjp(lambda anchor: loss_sum(gat, anchor, x, y, self.cfg, scale, self.tp,
                                                      self.recompute))(0.0)
        gat.forward = False
        with training_pass():
            vjp(vspace(value).ones())
        return float(value)

    def loss(self, x, y, scale: float) -> float:
        self.gatherer.forward = True
        return float(loss_sum(self.gatherer, 0.0, x, y, self.cfg, scale, self.tp, False))

    def whole(self) -> np.ndarray:
        """Collective over the data-parallel group: the whole flat parameter buffer (this slice's)."""
        full = self.layout.zeros()
        self.dp.Allgather(full, "allgather of the parameter shards", send=self.params)
        return full


class ShardedReplicaCheck:
    """Invariant (b) at ZeRO-3 (capstone.parallel.replicas' interface): the ranks of a data-parallel
    group hold different shards, but must have assembled the same groups; the step's norm is the
    whole model's, from every rank's share."""

    def __init__(self, grid, layout: Layout, gatherer: Gatherer):
        from capstone.parallel.replicas import ReplicaCheck
        self.world, self.gatherer, self.weight = grid.world, gatherer, None
        if grid.tp.size > 1:
            from capstone.parallel import tensor
            self.weight = tensor.norm_weight(layout, grid.tp.rank, *layout.shard_range(grid.dp.rank))
        self.record_to = ReplicaCheck(grid, layout)

    @property
    def checked(self) -> int:
        return self.record_to.checked

    @property
    def mismatches(self) -> list:
        return self.record_to.mismatches

    def check(self, step: int, params: np.ndarray, strong: bool) -> tuple[float, str]:
        """Collective over the world: (whole-model parameter norm, digest of the gathered groups)."""
        digest = self.gatherer.digest()
        self.gatherer.reset()
        mine = np.array([sum_squares(params, self.weight), 0.0])
        mine[1:].view(np.uint64)[0] = int(digest, 16)
        every = np.empty((self.world.size, 2))
        self.world.Allgather(every, "allgather of the gathered groups' fingerprints", "allgather_checks", send=mine)
        self.record_to.record(step, [f"{int(e[1:].view(np.uint64)[0]):016x}" for e in every])
        return float(np.sqrt(np.add.reduce(every[:, 0]))), digest
