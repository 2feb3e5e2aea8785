"""The memory tier (`--memory-tier K`): every K steps each rank keeps what a checkpoint holds of its shard
(master, m and v in the file's canonical view, Adam's t, the run state) in node-local memory, a file in a
tmpfs (CAPSTONE_MEMORY_DIR, default /dev/shm: it outlives the processes, which Open MPI 4.1 ends together
when one fails), and its buddy, a rank on another node, keeps a copy of it in its own node's memory.

A step's files are `<dir>/capstone-<run id>/step-<S>/own-rank-<R>` and, on the buddy's node, `copy-rank-<R>`:
the rows (len(ROWS), shard) as float32, then a trailer of TRAILER bytes: a magic number, the header's length
and CRC-32, and the header (JSON), which holds the rows' CRC-32 (zlib.crc32: a cheap digest against corruption
in memory, 4 GB/s here where sha256 is 1.8). The copy is the own file's bytes, sent without blocking right
after the own file is written and received straight into the copy's file while the next step runs: one
that was cut off fails its CRC and is never taken. The buddy is a rank of another host (`buddies`).

Retention: at step S the files of steps before S - 2K go. S - 2K is then complete on every rank and buddy
(every rank finished the boundary of S - K, where the copies of S - 2K were waited for, before step S's
collectives could end), S - K's own files are complete everywhere, and S is being written.

A tmpfs too full for a step's files (posix_fallocate refuses them: no file is half there) is reported once
and the run goes on with its disk checkpoints; so does a tier the ranks cannot create. Recovery is
capstone.checkpoint.recover.
"""

import glob
import json
import mmap
import os
import secrets
import shutil
import socket
import struct
import zlib

import numpy as np

from capstone.checkpoint.files import MIB, free_bytes
from capstone.step.state import ROWS

MAGIC = 0xCA9570E5
TRAILER = 1 << 18           # bytes after the rows: the fixed head (16 bytes) and the header JSON
HEAD = struct.Struct("<III")   # magic, header length, header CRC-32 (the header holds the rows' CRC-32)
TAG = 0x7E1                 # of the buddy's copy on the world communicator


def root() -> str:
    return os.environ.get("CAPSTONE_MEMORY_DIR") or "/dev/shm"


def run_dir(run_id: str) -> str:
    """This run's tier on this node (another run's id names another directory: never taken)."""
    return os.path.join(root(), f"capstone-{run_id}")


def step_dir(run_id: str, step: int) -> str:
    return os.path.join(run_dir(run_id), f"step-{step:08d}")


def buddies(hosts: list[str]) -> list[int | None]:
    """Each rank's buddy, a rank on another host: the i-th rank of a host keeps its copy with the (i mod n)-th of
    the n ranks on other hosts (for equal blocks: the same local rank on the next node); None on one host."""
    def buddy(r: int) -> int | None:
        others = [q for q in range(len(hosts)) if hosts[q] != hosts[r]]
        return others[hosts[:r].count(hosts[r]) % len(others)] if others else None
    return [buddy(r) for r in range(len(hosts))]


def say(comm, text: str) -> None:
    """One line, from rank 0."""
    if comm.rank == 0:
        print(text, flush=True)


def file_bytes(shard: int) -> int:
    return len(ROWS) * shard * 4 + TRAILER


def mapped(path: str, size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A file of `size` bytes, its blocks reserved (posix_fallocate: OSError, never a SIGBUS, on a full tmpfs),
    mapped; and its bytes as a uint8 array."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return m, np.frombuffer(m, dtype=np.uint8)


def seal(buf: np.ndarray, header: dict) -> None:
    """Write the trailer after the rows of `buf` (a file's bytes): their CRC and `header`."""
    rows = buf[:-TRAILER]
    text = json.dumps({**header, "nbytes": int(rows.size), "rows_crc": zlib.crc32(rows)}, sort_keys=True).encode()
    if HEAD.size + len(text) > TRAILER:
        raise OSError(f"the memory tier's header is {len(text)} bytes, more than its {TRAILER - HEAD.size}")
    tail = HEAD.pack(MAGIC, len(text), zlib.crc32(text)) + text
    buf[-TRAILER:-TRAILER + len(tail)] = np.frombuffer(tail, np.uint8)


def header_of(path: str) -> dict | None:
    """A tier file's header if its trailer is whole (its CRC matches), else None; the rows are not read."""
    try:
        with open(path, "rb") as f:
            f.seek(-TRAILER, os.SEEK_END)
            tail = f.read(TRAILER)
        magic, n, crc = HEAD.unpack_from(tail)
        text = tail[HEAD.size:HEAD.size + n]
        return json.loads(text) if magic == MAGIC and len(text) == n and zlib.crc32(text) == crc else None
    except (OSError, ValueError, struct.error):
        return None


def rows_of(path: str, header: dict) -> np.ndarray | None:
    """The rows of a tier file whose header was read, if their CRC matches (else None: a flipped byte, a cut copy)."""
    try:
        data = np.fromfile(path, dtype=np.uint8, count=header["nbytes"])
    except (OSError, ValueError):
        return None
    if data.size != header["nbytes"] or zlib.crc32(data) != header["rows_crc"]:
        return None
    return data.view("<f4").reshape(len(ROWS), -1)


class MemoryTier:
    """This rank's side of the tier (collective methods: call on all ranks)."""

    def __init__(self, comm, run_id: str, every: int, shard: int, first: int):
        self.comm, self.run_id, self.every, self.shard = comm, run_id, every, shard
        self.host, self.launch = socket.gethostname(), comm.bcast_json(secrets.token_hex(4) if comm.rank == 0 else None)
        self.prune(0, after=first - 1)   # an earlier launch's steps from this one's first: never mixed with its own
        chosen = buddies(comm.allgather_json(self.host))
        self.buddy = chosen[comm.rank]                                        # who keeps my copy
        self.sources = [q for q, b in enumerate(chosen) if b == comm.rank]    # whose copies I keep
        self.pending: list = []     # (request, mmap) of the copies in flight
        self.kept, self.peak = 0, 0   # steps kept; the most bytes of this rank's files at once
        if self.buddy is None:
            say(self.comm, "note: --memory-tier: every rank is on one host, so no copy is kept on another node: "
                           "the tier survives a lost process, not a lost node")

    def keep(self, step: int, stored, meta: dict) -> None:
        """Collective, at the end of step `step` (every K-th): this rank's file, and its copy sent to the buddy."""
        if not self.every:   # off since a step did not fit
            return
        self.finish()
        here, size = step_dir(self.run_id, step), file_bytes(self.shard)
        error = mine = None
        try:
            self.prune(step - 2 * self.every)
            os.makedirs(here, exist_ok=True)
            mine = mapped(os.path.join(here, f"own-rank-{self.comm.rank}"), size)
            for row, values in zip(np.ndarray((len(ROWS), self.shard), "<f4", mine[0]), stored.rows()):
                np.copyto(row, values)
            seal(mine[1], {"run_id": self.run_id, "step": step, "rank": self.comm.rank, "world": self.comm.size,
                           "shard": self.shard, "adam_t": int(stored.t), "launch": self.launch, "meta": meta})
            theirs = [(q, mapped(os.path.join(here, f"copy-rank-{q}"), size)) for q in self.sources]
        except OSError as exc:
            error = f"rank {self.comm.rank} on {self.host}: {exc.strerror or exc}"
        if self.agreed_off(error, step, size):
            return
        self.kept += 1
        files = glob.glob(os.path.join(run_dir(self.run_id), "*", "*"))
        self.peak = max(self.peak, sum(os.path.getsize(p) for p in files if os.path.basename(p) in self.names()))
        if self.buddy is not None:
            self.pending = [(self.comm.Isend(mine[1], self.buddy, TAG), mine[0])]
            self.pending += [(self.comm.Irecv(buf, q, TAG), m) for q, (m, buf) in theirs]

    def names(self) -> list[str]:
        """This rank's files of a step: its own and the copies it keeps."""
        return [f"own-rank-{self.comm.rank}"] + [f"copy-rank-{q}" for q in self.sources]

    def bound(self) -> int:
        """The formula of `peak`: 3 steps at most (see the module), each this rank's files."""
        return min(self.kept, 3) * len(self.names()) * file_bytes(self.shard)

    def agreed_off(self, error: str | None, step: int, size: int) -> bool:
        """Collective: whether a rank could not keep step `step` (then the tier is off, said once by rank 0)."""
        errors = [e for e in self.comm.allgather_json(error) if e]
        if errors:
            free = free_bytes(root())
            say(self.comm, f"warning: --memory-tier: step {step} does not fit in node memory ({'; '.join(errors)}; "
                           f"each rank needs {3 * len(self.names()) * size / MIB:.1f} MiB in {root()}, "
                           f"{'?' if free is None else f'{free / MIB:.1f}'} MiB free there): the run goes on with its "
                           f"disk checkpoints only. Free memory there (or set CAPSTONE_MEMORY_DIR) for the next run.")
            self.every = 0
            shutil.rmtree(step_dir(self.run_id, step), ignore_errors=True)
        return bool(errors)

    def finish(self) -> None:
        """Wait for the copy in flight (sent and received: the buddy's file is then complete)."""
        if self.pending:
            self.comm.wait([r for r, _ in self.pending], "memory tier: the copy of a step to the buddy's node")
            self.pending = []

    def prune(self, oldest: int, after: int | None = None) -> None:
        """Remove this node's files of steps before `oldest` or after `after` (the other ranks' here with them)."""
        for name in os.listdir(run_dir(self.run_id)) if os.path.isdir(run_dir(self.run_id)) else ():
            if name.startswith("step-") and not oldest <= int(name[5:]) <= (after if after is not None else 1 << 62):
                shutil.rmtree(os.path.join(run_dir(self.run_id), name), ignore_errors=True)

    def close(self) -> None:
        """At the end of a run whose last state is on disk: the copy in flight completed, the tier gone."""
        self.finish()
        shutil.rmtree(run_dir(self.run_id), ignore_errors=True)
