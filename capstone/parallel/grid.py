"""The process grid: the world's N ranks as dp x pp x cp x tp, every axis present (size 1 when unused).

Rank order, as in picotron: tensor parallel fastest (a TP group is tp consecutive ranks, so it
stays on one node), then context parallel, then pipeline, data parallel slowest:

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

Each axis has a `Comm` of the ranks that differ only in that coordinate, except `dp`: the ranks
that hold the same parameters, i.e. the dp x cp ranks of a pipeline stage's tensor-parallel slice
(context parallelism splits the sequence, not the model), over which the gradient is reduced and
the ZeRO state sharded, ordered dp_rank * cp + cp_rank. `cp` is the ring of one sequence's parts
(capstone.model.ring); `mp` (model parallel) is the pp x tp ranks of one replica (one dp and cp
coordinate), which together hold one whole model. An axis of size 1 is
`MPI.COMM_SELF` and an axis that spans the world is the world itself, so plain data parallelism
builds no communicator at all. The `Grid` is built once and passed in; nothing is global.
"""

import socket
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from capstone.collective.comm import Comm
from capstone.parallel import placement
from capstone.plan import Plan


@dataclass(frozen=True)
class Grid:
    """This rank's coordinates in the dp x pp x cp x tp grid and a Comm per axis (`dp`: dp x cp)."""

    world: Comm
    dp: Comm
    pp: Comm
    tp: Comm
    mp: Comm              # the pp x tp ranks of this replica (one whole model)
    cp: Comm              # the context-parallel ring (capstone.model.ring)
    hosts: tuple = ()     # every rank's host name, by world rank (capstone.parallel.placement)

    @classmethod
    def build(cls, world: Comm, plan: Plan | None = None) -> "Grid":
        """Collective: call on all ranks of `world`. The grid of `plan` (made on this world; None: plain
        data parallelism). ConfigError on every rank if the launcher split a tensor-parallel group over hosts."""
        plan, hosts = plan or Plan(world=world.size), tuple(world.allgather_json(socket.gethostname()))
        plan.check_placement(list(hosts))
        tp, pp, cp, dp = plan.tp, plan.pp, plan.cp, plan.zero_group   # dp: the dp x cp ranks of the same parameters
        d, pc, t = placement.position(world.rank, pp * cp, tp)
        p, c = divmod(pc, cp)
        d = d * cp + c                                   # the rank in the dp x cp group

        def axis(size: int, color: int, key: int, name: str) -> Comm:
            if size in (1, world.size):   # the world itself, or this rank alone
                return world if size == world.size else world.derived(MPI.COMM_SELF)
            return world.split(color, key, name)
        return cls(world, axis(dp, p * tp + t, d, "data parallel"), axis(pp, d * tp + t, p, "pipeline"),
                   axis(tp, d * pp + p, t, "tensor parallel"), axis(tp * pp, d, p * tp + t, "model parallel"),
                   axis(cp, (d // cp * pp + p) * tp + t, c, "context parallel"), hosts)

    @property
    def cp_size(self) -> int:
        return self.cp.size

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: the ranks reading different sequences (dp, without cp)."""
        return self.dp.size // self.cp_size

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica, 0 .. replicas - 1 (the dp x cp group's ranks in runs of cp)."""
        return self.dp.rank // self.cp_size

    def part(self, rank: int) -> int:
        """The part of the model (pp_rank * tp + tp_rank) that world rank `rank` holds."""
        return rank // (self.cp_size * self.tp.size) % self.pp.size * self.tp.size + rank % self.tp.size

    def norm_weight(self, layout) -> np.ndarray | None:
        """Per element of this rank's data-parallel shard of `layout`: its weight in a norm (tensor parallelism:
        ones, and zeros where tp rank 0 counts a whole parameter alone: capstone.parallel.tensor.norm_weight); None:
        every element counts."""
        if self.tp.size == 1:
            return None
        from capstone.parallel import tensor
        return tensor.norm_weight(layout, self.tp.rank, *layout.shard_range(self.dp.rank))

    def replica_ranks(self) -> list[int]:
        """The world ranks of this rank's replica (its dp and cp coordinates), in part order."""
        per, tp, cp, me = self.world.size // self.replicas, self.tp.size, self.cp_size, self.world.rank
        return [r for r in range(self.world.size) if r // per == me // per and r // tp % cp == me // tp % cp]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(dp, pp, tp), dp counting the dp x cp ranks that hold the same parameters."""
        return self.dp.size, self.pp.size, self.tp.size

    def placement(self) -> str:
        """Which host holds which grid position ('' on one host)."""
        if len(set(self.hosts)) < 2:
            return ""
        return placement.describe(list(self.hosts), self.pp.size * self.cp_size, self.tp.size)

    def describe(self) -> dict:
        return {"dp": self.replicas, "pp": self.pp.size, "cp": self.cp_size, "tp": self.tp.size,
                "order": "rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank",
                "tp_group": "tp consecutive ranks", "dp_group": "ranks with equal pp_rank and tp_rank (dp x cp)"}


def allgathered(comm: Comm, mine: np.ndarray, what: str, kind: str | None = None) -> np.ndarray:
    """Collective over `comm`: every rank's `mine` (of one shape and dtype on every rank), stacked in rank order."""
    every = np.empty((comm.size, *mine.shape), dtype=mine.dtype)
    comm.Allgather(every, what, kind, send=np.ascontiguousarray(mine))
    return every
