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

from __future__ import annotations

import socket
from dataclasses import dataclass

from mpi4py import MPI

from capstone.config import ConfigError
from capstone.collective.comm import Comm
from capstone.parallel import placement


def check(world: int, tp: int, pp: int, mcfg, cp: int = 1) -> None:
    """ConfigError if a tp x pp x cp split of this model does not fit `world` ranks (the same verdict
    on every rank: it depends only on the flags and the world size)."""
    for flag, k in (("--tp", tp), ("--pp", pp), ("--cp", cp)):
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {k!r}; 1 turns that axis off.")
    if world % (tp * pp):
        raise ConfigError(f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {world} ranks: the grid is "
                          f"(ranks / (tp x pp)) data-parallel replicas of tp x pp ranks. Launch a multiple of "
                          f"{tp * pp} ranks, or choose --tp and --pp whose product divides {world}.")
    if mcfg.n_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide n_heads {mcfg.n_heads}: attention is split by whole heads. "
                          f"Use a --tp that divides {mcfg.n_heads}.")
    if pp > mcfg.n_layers:
        raise ConfigError(f"--pp {pp} is more pipeline stages than the model's {mcfg.n_layers} blocks: every "
                          f"stage holds at least one block. Use --pp <= {mcfg.n_layers} (or, for a model built here, not "
                          f"--init-from, more --n-layers).")
    if cp > 1:
        _check_cp(world // (tp * pp), cp, mcfg.seq_len)


def _check_cp(ranks: int, cp: int, seq_len: int) -> None:
    if ranks % cp:
        raise ConfigError(f"--cp {cp} does not divide the {ranks} ranks per tensor- and pipeline-parallel position "
                          f"(the world / (tp x pp)): each data-parallel replica splits its sequences over cp ranks. "
                          f"Choose a --cp that divides {ranks}, or launch a multiple of {cp} x tp x pp ranks.")
    if seq_len % (2 * cp):
        raise ConfigError(f"--cp {cp}: --seq-len {seq_len} is not a multiple of 2 x cp = {2 * cp}: the balanced split "
                          f"cuts each sequence into 2 x cp equal chunks, cp rank i taking chunks i and 2cp-1-i, so "
                          f"that every rank does the same causal attention work. Use a --seq-len divisible by "
                          f"{2 * cp}.")


@dataclass(frozen=True)
class Grid:
    """This rank's coordinates in the dp x pp x cp x tp grid and a Comm per axis (`dp`: dp x cp)."""

    world: Comm
    dp: Comm
    pp: Comm
    tp: Comm
    mp: Comm              # the pp x tp ranks of this replica (one whole model)
    hosts: tuple = ()     # every rank's host name, by world rank (capstone.parallel.placement)
    cp: Comm | None = None   # the context-parallel ring (None: cp 1, see `ring`)

    @classmethod
    def build(cls, world: Comm, tp: int = 1, pp: int = 1, cp: int = 1) -> "Grid":
        """Collective: call on all ranks of `world` (sizes already `check`ed). ConfigError on every
        rank if the launcher split a tensor-parallel group over hosts."""
        hosts = tuple(world.allgather_json(socket.gethostname()))
        placement.check(list(hosts), pp * cp, tp)
        dp = world.size // (tp * pp)                     # the dp x cp ranks that hold the same parameters
        d, rest = divmod(world.rank, tp * pp * cp)
        p, rest = divmod(rest, tp * cp)
        c, t = divmod(rest, tp)
        d = d * cp + c                                   # the rank in the dp x cp group

        def axis(size: int, color: int, key: int, name: str) -> Comm:
            if size == world.size:
                return world
            if size == 1:
                return world.derived(MPI.COMM_SELF)
            return world.split(color, key, name)
        return cls(world, axis(dp, p * tp + t, d, "data parallel"), axis(pp, d * tp + t, p, "pipeline"),
                   axis(tp, d * pp + p, t, "tensor parallel"), axis(tp * pp, d, p * tp + t, "model parallel"), hosts,
                   axis(cp, (d // cp * pp + p) * tp + t, c, "context parallel"))

    @property
    def cp_size(self) -> int:
        return 1 if self.cp is None else self.cp.size

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

    def replica_ranks(self, of: int | None = None) -> list[int]:
        """The world ranks of world rank `of`'s replica (its dp and cp coordinates; None: this rank's),
        in part order."""
        per, tp, cp = self.world.size // self.replicas, self.tp.size, self.cp_size
        me = self.world.rank if of is None else of
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
        pp, tp, cp = self.pp.size, self.tp.size, self.cp_size
        return {"dp": self.replicas, "pp": pp, "cp": cp, "tp": tp,
                "order": "rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank",
                "tp_group": "tp consecutive ranks", "dp_group": "ranks with equal pp_rank and tp_rank (dp x cp)"}
