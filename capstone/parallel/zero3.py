"""ZeRO-3: the parameters are sharded too. A rank keeps its shard of the flat parameter buffer
(what ZeroAdam updates); a layer's group is allgathered from the data-parallel shards just before
its forward and freed after it, gathered again for its backward, and the next group's gather is
started while the current one computes (prefetch, driven by capstone.parallel.progress's thread).

This is the model's seam (capstone.model.seam) implemented by a `Gatherer`, not another model: the
model's layers ask it for a group's weights by name (the autograd graph holds none, so no gathered
block lives until its backward), and hand it each group's gradient, which goes straight to the
ZeRO-2 reducer (capstone.parallel.zero2). Each gathered group is fingerprinted once a step:
invariant (b), where no two ranks hold the same shard, compares what they do share, the groups
they assembled (capstone.parallel.replicas).
"""

import hashlib
from typing import Callable

import numpy as np

from capstone.data.heldout import HeldOut
from capstone.model.fingerprint import sum_squares, word_sum
from capstone.model.params import DTYPE, Layout
from capstone.model.precision import values
from capstone.model.seam import Sinks
from capstone.parallel.buckets import GroupPlan
from capstone.parallel.progress import Progress
from capstone.parallel.grid import allgathered
from capstone.parallel.replicas import ReplicaCheck
from capstone.parallel.zero import ZeroAdam


class ShardedAdam(ZeroAdam):
    """ZeroAdam over a parameter shard: `params` is this rank's shard alone (each rank made its own,
    capstone.run), and an update is not allgathered: the layers gather what they need."""

    def _adopt(self, params: np.ndarray) -> np.ndarray:
        if params.dtype != DTYPE or params.shape != (self.layout.shard,) or not params.flags.c_contiguous:
            raise ValueError(f"params must be a contiguous float32 shard of length {self.layout.shard}")
        return params.copy()

    def _publish(self) -> None:
        self.cast(self.params, self.state.master)


class Gatherer:
    """The seam over this rank's parameter shard: gathers groups from the data-parallel shards on
    demand, one group ahead in the direction of the pass; gradients go to `on_landed`, or land in
    `grads` (the reducer's whole buffer, --reshard step: reduced once, after the step's last
    micro-batch). `keep` (--reshard step): what a step gathers stays gathered until the step ends."""

    def __init__(self, dp, layout: Layout, shard: np.ndarray, names: tuple, progress: Progress, on_landed: Callable,
                 grads: np.ndarray | None = None, keep: bool = False):
        self.dp, self.layout, self.params, self.progress, self.grads = dp, layout, shard, progress, grads
        self.plans = {g: GroupPlan(a, b, layout, dp.rank) for g, (a, b) in layout.group_ranges().items()}
        self.order, self.out = list(names), Sinks(None if grads is None else layout.groups(grads), on_landed)
        self.keep, self.holding, self.live, self.peak, self.digests = keep, False, {}, 0, {}

    def gathered_peak(self) -> int:
        return self.peak

    def gathered_bound(self) -> int:
        """The formula for `peak`: the largest two consecutive groups (one computing, the next in
        flight), or (`keep`) every group of this rank's part of the model."""
        sizes = [self.params.itemsize * (self.plans[g].b - self.plans[g].a) for g in self.order]   # bf16: 2
        if self.keep:
            return sum(sizes)
        bound = max([sizes[0]] + [x + y for x, y in zip(sizes, sizes[1:])])
        tied = {"head", "embed"} <= set(self.order) and all(n != "lm_head.w" for n, _, _ in self.layout.entries)
        # tied: the head's backward borrows wte, the last block in flight
        return max(bound, sizes[0] + sum(sizes[-2:])) if tied else bound

    def _start(self, name: str) -> None:
        plan = self.plans[name]
        # bf16: gathered as bfloat16
        full, mine = np.empty(plan.b - plan.a, dtype=self.params.dtype), np.ascontiguousarray(self.params[plan.recv])
        if self.dp.size > 1:
            ticket = self.progress.submit(self.dp.Iallgatherv(mine, full, plan.counts), mine)
        else:
            full[...], ticket = mine, None
        self.live[name] = (full, ticket)
        self.peak = max(self.peak, sum(a.nbytes for a, _ in self.live.values()))

    def weights(self, name: str, backward: bool = False) -> np.ndarray:
        """Group `name`'s full array (waiting for its gather), and the next group's gather started
        (the next in the forward order, or in the backward's reverse order)."""
        if name not in self.live:
            self._start(name)
        full, i = self._wait(name), self.order.index(name) + (-1 if backward else 1)
        if 0 <= i < len(self.order) and self.order[i] not in self.live:
            self._start(self.order[i])
        if name not in self.digests:
            self.digests[name] = word_sum(full)
        return values(full)

    def _wait(self, name: str) -> np.ndarray:
        full, ticket = self.live[name]
        if ticket is not None:
            ticket.wait(self.dp, f"allgather of the parameters of {name} (ZeRO-3)", "allgather_params", "allgatherv",
                        full.nbytes)
            self.live[name] = (full, None)
        return full

    def release(self, name: str) -> None:
        if not self.holding:
            self.live.pop(name, None)

    def step(self, begins: bool) -> None:
        """`keep`: hold what the step gathers from now on; at its end, drop it (the update follows)."""
        if self.keep and not begins:
            for name in list(self.live):     # nothing is in flight at a step's end; were it, wait
                self._wait(name)
            self.live.clear()
        self.holding = self.keep and begins

    def grad_out(self, name: str, fresh: bool) -> np.ndarray:
        return self.out.grad_out(name, fresh, self.plans[name].b - self.plans[name].a)

    def landed(self, name: str, grad: np.ndarray, fresh: bool) -> None:
        self.out.landed(name, grad, fresh)

    def whole(self) -> np.ndarray:
        """Collective over the data-parallel group: the whole flat parameter buffer (this slice's)."""
        full = np.zeros(self.layout.padded, dtype=self.params.dtype)
        self.dp.Allgather(full, "allgather of the parameter shards", send=self.params)
        return values(full)

    def digest(self) -> str:
        """16 hex digits of the groups gathered this step (the same on every rank of the group); the
        fingerprints start again for the next step (`peak` is the run's)."""
        text, self.digests = ",".join(f"{g}:{self.digests[g]:x}" for g in sorted(self.digests)), {}
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class ShardedReplicaCheck(ReplicaCheck):
    """Invariant (b) at ZeRO-3 (capstone.parallel.replicas' interface and record): the ranks of a
    data-parallel group hold different shards, but must have assembled the same groups; the step's
    norm is the whole model's, from every rank's share."""

    def __init__(self, grid, layout: Layout, gatherer: Gatherer):
        super().__init__(grid, layout)
        self.gatherer, self.weight = gatherer, grid.norm_weight(layout)

    def check(self, step: int, params: np.ndarray, strong: bool) -> tuple[float, str]:
        """Collective over the world: (whole-model parameter norm, digest of the gathered groups)."""
        digest, mine = self.gatherer.digest(), np.array([sum_squares(params, self.weight), 0.0])
        mine[1:].view(np.uint64)[0] = int(digest, 16)
        every = allgathered(self.world, mine, "allgather of the gathered groups' fingerprints", "allgather_checks")
        self.record(step, [f"{int(e[1:].view(np.uint64)[0]):016x}" for e in every])
        return float(np.sqrt(np.add.reduce(every[:, 0]))), digest


class GatheredHeldOut(HeldOut):
    """The held-out loss at ZeRO-3, where every forward gathers over the data-parallel group: a rank
    left without rows of a batch (fewer rows than ranks) runs a forward on another rank's rows and
    does not count it, so every rank makes the same gathers."""

    def __init__(self, data, batches: int, batch_size: int, seq_len: int, world, dp_rank: int, dp: int,
                 loss, weight: float = 1.0):
        super().__init__(data, batches, batch_size, seq_len, world, dp_rank, dp, loss, weight)
        self.spare = data.val_batch(0, batch_size, 0, dp)

    def loss_share(self) -> float:
        """The spare forward's loss is not counted: it makes the gathers of the ranks with rows."""
        losses = [self.loss(*(batch if len(batch[0]) else self.spare), self.scale) for batch in self.batches]
        return sum(loss for loss, (x, _) in zip(losses, self.batches) if len(x)) * self.weight
