"""Invariant (b) at every step: the replicas of each part of the model hold the same parameters.

Every rank fingerprints its flat parameter buffer (`capstone.model.params.fingerprint`: sha256 on
evaluation steps, the cheap word sum otherwise; under --deterministic the unpadded parameters with
a layout-independent norm). One allgather over the world gives every rank every fingerprint, so
every rank records the same verdict: the ranks of a data-parallel group (the same tensor-parallel
slice and pipeline stage) must agree. The step's `param_norm` is the whole model's: the sum of
squares of a replica's parts, each parameter counted once.
"""

from __future__ import annotations

import math

from capstone.model.params import fingerprint, is_split, sum_squares


class ReplicaCheck:
    """(b)'s record: how many steps were checked and the ones where replicas differed."""

    def __init__(self, grid, layout, fingerprint_fn=None):
        self.world, self.tp_rank = grid.world, grid.tp.rank
        self.parts = grid.mp.size                      # ranks per replica
        self.layout, self.fingerprint = layout, fingerprint_fn or fingerprint
        self.checked, self.mismatches = 0, []

    def check(self, step: int, params, strong: bool) -> tuple[float, str]:
        """Collective over the world: this rank's (whole-model parameter norm, fingerprint)."""
        norm, digest = self.fingerprint(params, strong)
        owned = norm * norm if self.parts == 1 else self._owned_sumsq(params)
        every = self.world.allgather_json([norm, digest, owned])
        self.record(step, [[e[0], e[1]] for e in every])
        if self.parts == 1:
            return norm, digest
        replica = self.world.rank // self.parts
        return math.sqrt(sum(e[2] for e in every[replica * self.parts:(replica + 1) * self.parts])), digest

    def _owned_sumsq(self, params) -> float:
        """Sum of squares of the parameters this rank counts for its replica: its split ones, and
        the ones every tensor-parallel rank holds whole on tp rank 0 only."""
        views = self.layout.views(params)
        return sum(sum_squares(views[name].reshape(-1)) for name, _, _ in self.layout.entries
                   if is_split(name) or self.tp_rank == 0)

    def record(self, step: int, every: list) -> None:
        """`every`: one value per world rank; ranks with the same rank % parts must agree."""
        self.checked += 1
        groups = [every[p::self.parts] for p in range(self.parts)]
        if any(x != g[0] for g in groups for x in g):
            self.mismatches.append({"step": step, "fingerprints": every})
