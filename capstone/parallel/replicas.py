"""Invariant (b) at every step: the replicas of each part of the model hold the same parameters
(docs/design.md, "Inside the step", parallel/replicas.py)."""

import math

import numpy as np

from capstone.model.fingerprint import fingerprint


class ReplicaCheck:
    """(b)'s record: how many steps were checked and the ones where replicas differed."""

    def __init__(self, grid, layout):
        # parts: the ranks of a replica (its model-parallel group)
        self.world, self.tp_rank, self.layout, self.parts = grid.world, grid.tp.rank, layout, grid.mp.size
        self.part_of, self.mates = [grid.part(r) for r in range(grid.world.size)], grid.replica_ranks()
        self.checked, self.mismatches = 0, []

    def check(self, step: int, params, strong: bool) -> tuple[float, str]:
        """Collective over the world: this rank's (whole-model parameter norm, fingerprint)."""
        norm, digest = fingerprint(params, strong)
        owned = norm * norm
        if self.parts > 1:   # this rank's share of its replica's sum of squares
            from capstone.parallel import tensor
            owned = tensor.owned_sumsq(self.layout, params, self.tp_rank)
        mine = np.array([norm, owned, 0.0])
        mine[2:].view(np.uint64)[0] = int(digest, 16)                   # the 64-bit digest, as its bits
        every = np.empty((self.world.size, 3))
        self.world.Allgather(every, "allgather of the parameter fingerprints", "allgather_checks", send=mine)
        self.record(step, [[float(e[0]), f"{int(e[2:].view(np.uint64)[0]):016x}"] for e in every])
        return (norm if self.parts == 1 else math.sqrt(sum(every[self.mates, 1].tolist()))), digest

    def record(self, step: int, every: list) -> None:
        """`every`: one value per world rank; ranks holding the same part (`Grid.part`) must agree."""
        self.checked += 1
        groups = [[e for e, q in zip(every, self.part_of) if q == p] for p in range(self.parts)]
        if any(x != g[0] for g in groups for x in g):
            self.mismatches.append({"step": step, "fingerprints": every})
