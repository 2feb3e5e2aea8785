"""Checkpoint files on disk: names, atomic publish, the `latest` pointer, retention, quarantine.

A checkpoint directory holds complete files `ckpt-<step>.h5`, each with its digest file
`ckpt-<step>.h5.sha256` (see `integrity`), in-progress files `ckpt-<step>.h5.partial-<token>`
(and their `.sha256`; never read), checkpoints set aside as corrupt,
`ckpt-<step>.h5.corrupt-<token>` (never deleted, never read), and `latest`, a one-line text
file naming the newest complete checkpoint. A file becomes visible only by rename after every
rank has written and closed it and its digest file is in place; `latest` is replaced by rename
after that. So a process killed at any point leaves the previous `latest` and its file intact.

Before writing, rank 0 compares the free space (statvfs) with the size the file will have
(`estimated_size`); CAPSTONE_CHECK_SPACE=0 skips that for a filesystem whose statvfs is wrong.
"""

import os
import secrets
import shutil

from capstone.flags import paths
from capstone.config import ConfigError

MIB = 1 << 20
POINTER = paths.POINTER
PROBE = ".stop-probe"     # a run's measurement of its disk's speed (capstone.runtime.margin), removed after it
NAME_RE = paths.CHECKPOINT_NAME
DIGEST_SUFFIX = paths.DIGEST_SUFFIX


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded; the message names the file and what to do."""


class CheckpointUsageError(CheckpointError, ConfigError):
    """A command line that names no checkpoint (no such file, not an HDF5 file) or one of another model than
    the flags ask for: the user's mistake to correct, so it exits 2 like any usage mistake."""


class CorruptCheckpoint(CheckpointError):
    """The file's bytes are not what was written (digest mismatch, truncated, unparseable): it can
    be set aside. Other refusals (no digest file, another format version, another model) cannot.
    `reason` is what is wrong, without the file name and the advice."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


def final_name(step: int) -> str:
    return f"ckpt-{step:08d}.h5"


def partial_name(step: int, token: str) -> str:
    return f"{final_name(step)}.partial-{token}"


def estimated_size(data_bytes: int, world: int, meta_bytes: int | None = None) -> int:
    """An upper bound of a checkpoint file's size: the shard data, /meta_json and HDF5's own
    metadata (measured: 8 KiB plus ~350 bytes per rank; /meta_json ~2.5 KiB plus ~150 per rank)."""
    return data_bytes + (4096 + 512 * world if meta_bytes is None else meta_bytes) + 16384 + 1024 * world


def free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged user can still write in `directory`'s filesystem (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def lacking_space(directory: str, need: int) -> int | None:
    """The free bytes in `directory` if fewer than `need`, else None (also when unknown, or
    when CAPSTONE_CHECK_SPACE=0)."""
    free = free_bytes(directory) if os.environ.get("CAPSTONE_CHECK_SPACE", "1") != "0" else None
    return free if free is not None and free < need else None


def space_error(directory: str, step: int, need: int) -> str | None:
    """Rank 0, before a save: the refusal when checkpoint `step` (about `need` bytes) cannot fit."""
    return None if (free := lacking_space(directory, need)) is None else (
        f"not enough space for checkpoint step {step} in {directory}: it needs about {need / MIB:.1f} MiB and "
        f"{free / MIB:.1f} MiB is free. Nothing was written; the previous checkpoint and 'latest' are "
        f"untouched. Free space there (delete checkpoints you do not need), then continue with --resume latest.")


def fsync_path(path: str) -> None:
    """fsync a file or directory so a rename or write survives a crash of the node."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp_path: str, final_path: str) -> None:
    """Make a fully written file visible under its final name, durably."""
    fsync_path(tmp_path)
    os.replace(tmp_path, final_path)
    fsync_path(os.path.dirname(os.path.abspath(final_path)))


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` durably: `write_atomic`, then its directory fsynced (the rename survives a crash)."""
    write_atomic(path, text.encode())
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` whole or not at all: a temp file beside it, fsynced, then renamed (prepare, export)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)     # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_pointer(directory: str, name: str) -> None:
    """Atomically point `latest` at checkpoint `name` (a file in `directory`)."""
    write_text(os.path.join(directory, POINTER), name + "\n")


def read_pointer(directory: str) -> str | None:
    """Path of the checkpoint `latest` names, or None if there is no pointer."""
    path = os.path.join(directory, POINTER)
    try:
        with open(path) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    if not NAME_RE.match(name):
        raise ValueError(f"{path} names {name!r}, which is not a checkpoint file name; "
                         f"pass --resume with an explicit ckpt-*.h5 path")
    return os.path.join(directory, name)


def step_of(path: str) -> int:
    """The step in a checkpoint's file name (0 if it is not one)."""
    return int(m.group(1)) if (m := NAME_RE.match(os.path.basename(path))) else 0


def set_aside_leftovers(directory: str) -> list[str]:
    """At a run's start (rank 0, the run directory locked): remove what a killed save left in
    `directory`, partial files (`*.h5.partial-*`, never complete, never read) and digest files
    without their checkpoint, and a killed start-up measurement's PROBE file. Returns their names."""
    if not os.path.isdir(directory):
        return []
    if os.path.isdir(probe := os.path.join(directory, PROBE)):   # a killed probe of the code before, a directory
        shutil.rmtree(probe, ignore_errors=True)
    elif os.path.exists(probe):
        os.remove(probe)
    return _remove_leftovers(directory)


def _remove_leftovers(directory: str) -> list[str]:
    """Remove the partial files and the orphan digest files in `directory` (the digest file of a complete
    checkpoint that is not there: a save killed between writing the digest file and renaming the checkpoint
    into place); the names of the partial files."""
    found = [n for n in sorted(os.listdir(directory)) if ".h5.partial-" in n or (stem := n.removesuffix(DIGEST_SUFFIX))
             != n and NAME_RE.match(stem) and not os.path.exists(os.path.join(directory, stem))]
    for name in found:
        os.remove(os.path.join(directory, name))
    return [n for n in found if not n.endswith(DIGEST_SUFFIX)]


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of complete checkpoint files in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    return sorted((int(m[1]), os.path.join(directory, n)) for n in os.listdir(directory) if (m := NAME_RE.match(n)))


def retain(directory: str, keep_last: int, protect=()) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all) with their digest
    files. Never deletes the file `latest` names, any path in `protect`, nor a quarantined file.
    Also removes leftover partial files and digest files whose checkpoint is gone. Returns the
    names of the checkpoints and partial files removed."""
    removed = _remove_leftovers(directory)
    if keep_last <= 0:
        return removed
    keep = {os.path.abspath(p) for p in [*protect, read_pointer(directory)] if p}   # and the file `latest` names
    for _, path in complete_checkpoints(directory)[:-keep_last]:
        if os.path.abspath(path) not in keep:
            os.remove(path)
            removed.append(os.path.basename(path))
            if os.path.exists(path + DIGEST_SUFFIX):
                os.remove(path + DIGEST_SUFFIX)
    return removed


def quarantine(path: str, why: str = "corrupt") -> str:
    """Set a corrupt checkpoint (or one the guard rejected, `why` "rejected") aside, never deleting it:
    rename it, then its digest file, to `<name>.<why>-<token>[.sha256]`, durably (a crash in between
    leaves an orphan digest file, which `retain` removes). Returns the new path of the checkpoint."""
    moved = f"{path}.{why}-{secrets.token_hex(4)}"
    os.replace(path, moved)
    if os.path.exists(path + DIGEST_SUFFIX):
        os.replace(path + DIGEST_SUFFIX, moved + DIGEST_SUFFIX)
    fsync_path(os.path.dirname(os.path.abspath(path)))
    return moved
