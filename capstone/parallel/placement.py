"""Which host holds which grid position (capstone.parallel.grid builds the grid).

A tensor-parallel group exchanges activations in every layer's forward and backward, so its ranks
must share a node; the grid's rank order keeps a TP group on tp consecutive ranks for that
(capstone.parallel.grid). Launchers place consecutive ranks on one node by default (Slurm's block
distribution, mpirun's --map-by slot). A placement that splits a TP group over hosts (for example
`srun --distribution=cyclic`, `mpirun --map-by node`) is refused by the plan (capstone.plan.Plan.check_placement),
with the reason and the fix, rather than re-mapped: a re-mapping would renumber the ranks behind the launcher's back (rank 0
writes the logs) and hide a launcher setting that also slows every other job of the site.
Hosts are told apart by host name (one per node on a cluster, and on scripts/hosts' hosts).
"""

def position(rank: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of a world rank: rank = (dp_rank * pp + pp_rank) * tp + tp_rank."""
    d, rest = divmod(rank, pp * tp)
    return (d, *divmod(rest, tp))


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}" if values == list(range(lo, hi + 1)) else ",".join(map(str, values))


def describe(hosts: list[str], pp: int, tp: int) -> str:
    """One line: each host, its ranks and their grid positions, e.g.
    'h1: ranks 0-1 = [dp0 pp0 tp0-1]; h2: ranks 2-3 = [dp1 pp0 tp0-1]'."""
    parts = []
    for host in dict.fromkeys(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        groups: dict[tuple[int, int], list[int]] = {}
        for d, p, t in (position(r, pp, tp) for r in ranks):
            groups.setdefault((d, p), []).append(t)
        where = " ".join(f"[dp{d} pp{p} tp{_span(ts)}]" for (d, p), ts in groups.items())
        parts.append(f"{host}: ranks {_span(ranks)} = {where}")
    return "; ".join(parts)
