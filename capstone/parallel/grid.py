"""The process grid: the world's N ranks as dp x pp x tp, every axis present (size 1 when unused).

Rank order, as in Megatron and picotron: tensor parallel fastest (a TP group is tp consecutive
ranks, so it stays on one node), then pipeline, data parallel slowest:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

Each axis has a `Comm` of the ranks that differ only in that coordinate; `mp` (model parallel) is
the pp x tp ranks of one replica, which together hold one whole model. An axis of size 1 is
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


def check(world: int, tp: int, pp: int, mcfg) -> None:
    """ConfigError if a tp x pp split of this model does not fit `world` ranks (the same verdict
    on every rank: it depends only on the flags and the world size)."""
    for flag, k in (("--tp", tp), ("--pp", pp)):
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
                          f"stage holds at least one block. Use --pp <= {mcfg.n_layers} or more --n-layers.")


@dataclass(frozen=True)
class Grid:
    """This rank's coordinates in the dp x pp x tp grid and a Comm per axis."""

    world: Comm
    dp: Comm
    pp: Comm
    tp: Comm
    mp: Comm              # the pp x tp ranks of this replica (one whole model)
    hosts: tuple = ()     # every rank's host name, by world rank (capstone.parallel.placement)

    @classmethod
    def build(cls, world: Comm, tp: int = 1, pp: int = 1) -> "Grid":
        """Collective: call on all ranks of `world` (sizes already `check`ed). ConfigError on every
        rank if the launcher split a tensor-parallel group over hosts."""
        hosts = tuple(world.allgather_json(socket.gethostname()))
        placement.check(list(hosts), pp, tp)
        dp = world.size // (tp * pp)
        d, rest = divmod(world.rank, tp * pp)
        p, t = divmod(rest, tp)

        def axis(size: int, color: int, key: int, name: str) -> Comm:
            if size == world.size:
                return world
            if size == 1:
                return world.derived(MPI.COMM_SELF)
            return world.split(color, key, name)
        return cls(world, axis(dp, p * tp + t, d, "data parallel"), axis(pp, d * tp + t, p, "pipeline"),
                   axis(tp, d * pp + p, t, "tensor parallel"), axis(tp * pp, d, rest, "model parallel"), hosts)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(dp, pp, tp)."""
        return self.dp.size, self.pp.size, self.tp.size

    def placement(self) -> str:
        """Which host holds which grid position ('' on one host)."""
        if len(set(self.hosts)) < 2:
            return ""
        return placement.describe(list(self.hosts), self.pp.size, self.tp.size)

    def describe(self) -> dict:
        dp, pp, tp = self.shape
        return {"dp": dp, "pp": pp, "tp": tp, "order": "rank = (dp_rank * pp + pp_rank) * tp + tp_rank",
                "tp_group": "tp consecutive ranks", "dp_group": "ranks with equal pp_rank and tp_rank"}
