"""Recovery from the memory tier (capstone.checkpoint.tier): `--resume auto` takes the newest step that the
nodes of this launch hold completely, newer than the newest disk checkpoint, each old rank's shard from its
own file or from its buddy's copy, verified; else it resumes from the disk (capstone.checkpoint.resume).

`find` (collective, before the run is built): every rank lists its node's files of this run (their headers
only); the ranks agree on the newest step of one launch whose every shard has a source; a rank on the node
of each shard's source reads it and checks its CRC-32: own files first, then copies, the next source when
one fails (a flipped byte, a copy cut off), the next older step when a shard has none left. `Found.load`
(collective, once the new layout is known) sends each rank the slices of the old shards that make its new
shard (one Alltoallv), as a checkpoint's load reshards, and returns what that load returns.
"""

import contextlib
import glob
import itertools
from itertools import accumulate
import os
import socket
from dataclasses import dataclass, field

import numpy as np

from capstone.checkpoint import files, rundir, tier
from capstone.step.state import ROWS, ShardState


@dataclass
class Found:
    """A step in the tier, verified, and which new rank holds each old rank's rows."""

    step: int
    world: int                      # ranks of the launch that kept it
    shard: int                      # their shard length
    meta: dict                      # the run's metadata, as a checkpoint's (judged: False)
    holders: list                   # old rank -> the new rank holding its verified rows
    sources: list                   # old rank -> "own on h1", "copy on h2"
    rows: dict = field(default_factory=dict)   # on this rank: old rank -> its rows (len(ROWS), shard)

    def __str__(self) -> str:
        return f"node memory (step {self.step})"

    def load(self, comm, layout) -> tuple[ShardState, dict]:
        """Collective: this rank's shard of `layout` from the holders' rows, and the metadata."""
        spans, n = [layout.shard_range(r) for r in range(comm.size)], layout.n_params
        held = [[k for k in range(self.world) if self.holders[k] == i] for i in range(comm.size)]
        send = [self.piece(k, *spans[j], n) for j in range(comm.size) for k in held[comm.rank]]
        counts = [sum(self.piece(k, *spans[j], n).size for k in held[comm.rank]) for j in range(comm.size)]
        lo, hi = spans[comm.rank]
        got = [sum(self.piece(k, lo, hi, n, size=True) for k in held[i]) for i in range(comm.size)]
        recv = np.empty(sum(got), np.float32)
        comm.Alltoallv(np.concatenate([*send, np.empty(0, np.float32)]), (counts, [*accumulate([0] + counts[:-1])]),
                       recv, (got, [*accumulate([0] + got[:-1])]), "memory tier: the shards to their new ranks")
        out, at = np.zeros((len(ROWS), hi - lo), np.float32), 0
        for k in (k for ks in held for k in ks):
            a, b = self.overlap(k, lo, hi, n)
            out[:, a - lo:b - lo] = recv[at:at + len(ROWS) * (b - a)].reshape(len(ROWS), b - a)
            at += len(ROWS) * (b - a)
        self.rows.clear()
        return ShardState(*out, t=self.meta["adam_t"]), self.meta

    def overlap(self, k: int, lo: int, hi: int, n: int) -> tuple[int, int]:
        a, b = max(lo, k * self.shard), min(hi, n, (k + 1) * self.shard)
        return a, max(a, b)

    def piece(self, k: int, lo: int, hi: int, n: int, size: bool = False):
        """Old shard k's rows over [lo, hi), flat (held here), or their count."""
        a, b = self.overlap(k, lo, hi, n)
        return len(ROWS) * (b - a) if size else self.rows[k][:, a - k * self.shard:b - k * self.shard].ravel()


def listing(run_id: str) -> list[dict]:
    """This node's files of run `run_id` whose trailer is whole (headers only)."""
    found, host = [], socket.gethostname()
    for path in sorted(glob.glob(os.path.join(tier.run_dir(run_id), "step-*", "*"))):
        if (h := tier.header_of(path)) is not None and h.get("run_id") == run_id:
            found.append({k: h[k] for k in ("step", "launch", "rank", "world")}
                         | {"path": path, "kind": os.path.basename(path).split("-")[0], "host": host})
    return found


def candidates(entries: list[tuple[int, dict]]) -> dict:
    """(step, launch, world) -> old rank -> its sources, own files first: [(kind, host, [(holder, path)])]."""
    steps: dict = {}
    for holder, e in entries:
        sources = steps.setdefault((e["step"], e["launch"], e["world"]), {}).setdefault(e["rank"], {})
        sources.setdefault((e["kind"] != "own", e["kind"], e["host"]), []).append((holder, e["path"]))
    return {key: {k: [(kind, host, v) for (_, kind, host), v in sorted(s.items())] for k, s in by_rank.items()}
            for key, by_rank in steps.items()}


def newest(comm, out: str, expected: bool) -> Found | None:
    """Collective: the newest step in the memory tier of the run in `out` that is newer than its newest disk
    checkpoint (by `latest`'s name: nothing of the disk is read) and verifies; None (said when the tier had
    newer steps, or the run keeps one: `expected`) if there is none."""
    def disk() -> tuple[str | None, int]:
        log, pointer = os.path.join(out, rundir.METRICS), os.path.join(out, "checkpoints", files.POINTER)
        with contextlib.suppress(OSError, ValueError):
            return (rundir.logged_run_id(log) if os.path.isfile(log) else None,
                    files.step_of(open(pointer).read().strip()) if os.path.isfile(pointer) else 0)
        return None, 0
    run_id, on_disk = comm.bcast_json(disk() if comm.rank == 0 else None)
    entries = [(i, e) for i, mine in enumerate(comm.allgather_json(listing(run_id) if run_id else [])) for e in mine]
    newer = sorted((key, by_rank) for key, by_rank in candidates(entries).items() if key[0] > on_disk)
    for (step, _, world), by_rank in reversed(newer):
        if sorted(by_rank) != list(range(world)):
            tier.say(comm, f"note: memory tier: step {step} is not whole on the nodes of this launch (no whole file "
                           f"of ranks {sorted(set(range(world)) - set(by_rank))} of its {world}: their node is gone, "
                           f"their copy too or not yet complete)")
        elif (found := verified(comm, step, by_rank, world)) is not None:
            tier.say(comm, f"resuming from node memory: step {step} of {world} ranks "
                           f"({', '.join(summary(found.sources))}); the newest disk checkpoint is step {on_disk}")
            return found
    if (newer or expected) and run_id:
        tier.say(comm, f"note: memory tier: the nodes of this launch hold no whole step of this run newer than the "
                       f"disk's (step {on_disk}): resuming from the disk")
    return None


def summary(sources: list[str]) -> list[str]:
    """"ranks 0-1: own on h1" for runs of equal sources."""
    runs = [[k for k, _ in run] for _, run in itertools.groupby(enumerate(sources), key=lambda ks: ks[1])]
    return [f"rank {r[0]}: {sources[r[0]]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}: {sources[r[0]]}" for r in runs]


def verified(comm, step: int, by_rank: dict, world: int) -> Found | None:
    """Collective: step `step` read from each shard's first source that verifies (None: a shard has none)."""
    tried, rows = {k: 0 for k in range(world)}, {}
    while True:   # a source: (kind, host, [(holder, path)]); a rank of its host reads it
        picked = {k: (by_rank[k][tried[k]][:2], (v := by_rank[k][tried[k]][2])[k % len(v)]) for k in range(world)}
        bad = []
        for k, ((kind, host), (holder, path)) in picked.items():
            if holder == comm.rank and k not in rows:
                header = tier.header_of(path)
                if header is None or (got := tier.rows_of(path, header)) is None:
                    bad.append([k, f"{os.path.basename(path)} of step {step} on {host} fails its CRC-32"])
                else:
                    rows[k] = got
        bad = [b for mine in comm.allgather_json(bad) for b in mine]
        for k, why in bad:
            tried[k] += 1
            tier.say(comm, f"warning: memory tier: {why}: rejected; taking "
                f"{'the next source' if tried[k] < len(by_rank[k]) else 'an older step (no other source)'}")
        if any(tried[k] == len(by_rank[k]) for k, _ in bad):
            return None
        if not bad:
            break
    holders = [picked[k][1][0] for k in range(world)]
    h = comm.bcast_json(tier.header_of(picked[0][1][1]) if holders[0] == comm.rank else None, root=holders[0])
    meta = {**h["meta"], "adam_t": h["adam_t"], "world_size": h["world"], "judged": False}
    sources = [f"{picked[k][0][0]} on {picked[k][0][1]}" for k in range(world)]
    return Found(step, world, h["shard"], meta, holders, sources, rows)
