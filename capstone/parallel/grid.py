"""The process grid of a run: N ranks = (N/K data-parallel replicas) x (K tensor-parallel ranks).

A tensor-parallel (TP) group is K consecutive world ranks (color rank // K); the data-parallel
(DP) group of a TP rank holds the ranks with the same rank % K, one per replica. This module is
the only one that builds communicators. With K = 1 nothing is split: the DP communicator is the
world communicator itself and the TP communicator is COMM_SELF, so a TP-1 run is exactly the
data-parallel run it always was.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from capstone.config import ConfigError


def check(tp: int, world: int, mcfg, tcfg=None) -> None:
    """ConfigError if K = tp cannot split this model on `world` ranks (same verdict on every rank:
    it depends only on the flags and the world size)."""
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"--tp must be a positive integer, got {tp!r}; --tp 1 is plain data parallelism.")
    if world % tp:
        raise ConfigError(f"--tp {tp} does not divide the {world} ranks: the grid is (ranks / tp) replicas x tp "
                          f"tensor-parallel ranks. Use a --tp that divides {world}, or launch a multiple of {tp} ranks.")
    if mcfg.n_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide n_heads {mcfg.n_heads}: attention is split by whole heads. "
                          f"Use a --tp that divides {mcfg.n_heads}.")
    if (4 * mcfg.d_model) % tp or mcfg.d_model % tp:
        raise ConfigError(f"--tp {tp} does not divide d_model {mcfg.d_model} and the MLP width 4*d_model "
                          f"{4 * mcfg.d_model}. Use a --tp that divides both.")
    if tp > 1 and tcfg is not None and tcfg.deterministic:
        raise ConfigError(f"--deterministic is not supported with --tp {tp} (its fixed-order reduction covers "
                          f"data parallelism only); drop one of them.")


@dataclass
class Grid:
    """The communicators and coordinates of this rank in the (dp x tp) grid."""

    world_comm: object
    tp_comm: object        # the K ranks of this replica (COMM_SELF when K = 1)
    dp_comm: object        # the replicas' ranks holding the same TP slice (the world when K = 1)
    tp: int
    dp: int
    rank: int
    tp_rank: int
    dp_rank: int

    @classmethod
    def build(cls, comm, tp: int, mcfg, tcfg=None) -> "Grid":
        """Collective: call on all ranks of `comm`. Validate K (ConfigError on every rank alike), then split."""
        world, rank = comm.Get_size(), comm.Get_rank()
        check(tp, world, mcfg, tcfg)
        if tp == 1:
            return cls(comm, MPI.COMM_SELF, comm, 1, world, rank, 0, rank)
        tp_comm = comm.Split(color=rank // tp, key=rank % tp)
        dp_comm = comm.Split(color=rank % tp, key=rank // tp)
        return cls(comm, tp_comm, dp_comm, tp, world // tp, rank, tp_comm.Get_rank(), dp_comm.Get_rank())

    def by_slice(self, values: list) -> list:
        """A world-ordered list (one value per rank) regrouped as one list per replica, each holding
        its K TP ranks' values: replicas agree iff every TP slice agrees across the DP group."""
        if self.tp == 1:
            return values
        return [values[d * self.tp:(d + 1) * self.tp] for d in range(self.dp)]

    def describe(self) -> dict:
        return {"tp": self.tp, "dp": self.dp, "tp_group": "K consecutive world ranks (rank // tp)",
                "dp_group": "ranks with equal rank % tp"}
