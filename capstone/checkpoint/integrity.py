"""Whole-file integrity of checkpoints: a digest file next to each one, checked before HDF5 parses it.

`ckpt-<step>.h5.sha256` holds the size and sha256 of every byte of `ckpt-<step>.h5`:

    # capstone checkpoint digest v1: 372539 bytes
    e683d39e...151189a11  ckpt-00000002.h5

(`sha256sum -c ckpt-00000002.h5.sha256` checks it too; it skips the comment). Rank 0 writes it,
fsynced, before the checkpoint is renamed into place, so every published checkpoint has one.
A reader hashes the file in chunks and compares before h5py opens it: a flipped byte anywhere
(HDF5 metadata, attributes, data) is refused with "not a valid checkpoint: FILE: reason", where
parsing it could raise arbitrary errors or crash the process. A checkpoint without a digest file
(written by an older capstone, or copied without it) is refused: nothing would protect the parser
from it; `python -m capstone.checkpoint seal FILE` adds one after checking every internal digest.
"""

import functools
import hashlib
import os
import re
import time

from capstone.flags import paths
from capstone.checkpoint import files
from capstone.checkpoint.files import DIGEST_SUFFIX, CheckpointError, CheckpointUsageError, CorruptCheckpoint

DIGEST_RE = re.compile(r"# capstone checkpoint digest v1: (\d+) bytes\n([0-9a-f]{64})  (\S+)\n")
NEXT = {"missing": "Check the path: pass a ckpt-*.h5 file, a run directory (--out) or its checkpoints/latest.",
        "unsealed": "Copy its .sha256 file along with it, or, if you trust the file, add one with `python -m "
                    "capstone.checkpoint seal {path}` (it checks every digest inside the file first).",
        "foreign": "Pass a ckpt-*.h5 file that capstone wrote, a run directory (--out) or its checkpoints/latest.",
        "corrupt": "Do not use it: resume from another checkpoint (--resume auto falls back to the newest one that "
                   "verifies and moves this one aside), or restore a good copy."}


def file_sha256(path: str) -> str:
    """sha256 of the file's bytes, read in chunks. Cached in this process per unchanged file (same
    inode, size, mtime and ctime), but only for a file last changed over 2 s before it was read,
    since a change within the clock's granularity would leave its times the same."""
    st = os.stat(path)
    if time.time() - max(st.st_mtime, st.st_ctime) > 2:
        return _sha256(os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return _sha256.__wrapped__(path)   # not settled: hashed, not cached


@functools.lru_cache(maxsize=256)
def _sha256(path: str, *identity) -> str:
    """sha256 of the file's bytes; cached once per `identity` of a settled file (a rewritten file has another)."""
    with open(path, "rb", buffering=0) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_digest(path: str, name: str | None = None) -> None:
    """Hash `path` and write its digest file `path.sha256` (naming `name`, default the file's own
    name) durably, by rename."""
    digest, size, name = file_sha256(path), os.path.getsize(path), name or os.path.basename(path)
    files.write_text(path + DIGEST_SUFFIX, f"# capstone checkpoint digest v1: {size} bytes\n{digest}  {name}\n")


def publish(tmp: str, final: str, between) -> None:
    """Rank 0, once every rank has closed `tmp`: write the digest file of `final`, then rename
    `tmp` to `final`. A crash in between (`between()` is called there: a test's crash point) leaves
    a digest file without its checkpoint, which `files.retain` removes."""
    write_digest(tmp, os.path.basename(final))
    files.publish(tmp + DIGEST_SUFFIX, final + DIGEST_SUFFIX)
    between()
    files.publish(tmp, final)


def recorded(path: str) -> tuple[int, str] | None:
    """(size, sha256) from `path`'s digest file; None if there is none; ValueError if malformed."""
    try:
        with open(path + DIGEST_SUFFIX, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    if not (m := DIGEST_RE.fullmatch(raw.decode("utf-8", "replace"))):
        raise ValueError(f"its digest file {path}{DIGEST_SUFFIX} is malformed")
    return int(m.group(1)), m.group(2)


def problem(path: str) -> tuple[str, str] | None:
    """None if `path` is a file whose bytes match its digest file, else (kind, reason) with kind
    "missing" (no such file), "foreign" (no digest file and not HDF5: not a checkpoint at all), "unsealed"
    (no digest file) or "corrupt". Never parses HDF5."""
    if not os.path.isfile(path):
        return "missing", "it is not a regular file" if os.path.exists(path) else "it does not exist"
    try:
        if (want := recorded(path)) is None and not _is_hdf5(path):
            return "foreign", "it is not an HDF5 file, so not a capstone checkpoint"
        if want is None:
            return "unsealed", (f"it has no digest file {os.path.basename(path)}{DIGEST_SUFFIX} (written by a "
                                f"capstone older than digest files, or copied without it)")
        if (size := os.path.getsize(path)) != want[0]:
            return "corrupt", f"it is {size} bytes but was written as {want[0]} bytes (truncated or overwritten)"
        digest = file_sha256(path)
    except (OSError, ValueError) as exc:
        return "corrupt", str(exc)
    if digest != want[1]:
        return "corrupt", (f"its sha256 is {digest} but was written as {want[1]} ({os.path.basename(path)}"
                           f"{DIGEST_SUFFIX}): the file was modified or damaged on disk")
    return None


def _is_hdf5(path: str) -> bool:
    with open(path, "rb") as f:   # the signature is at byte 0 of every file h5py writes (no user block)
        return f.read(len(paths.HDF5_SIGNATURE)) == paths.HDF5_SIGNATURE


def message(path: str, kind: str, reason: str) -> str:
    return f"not a valid checkpoint: {path}: {reason}. {NEXT[kind].format(path=path)}"


def check_file(path: str) -> None:
    """Raise CheckpointError ("not a valid checkpoint: FILE: reason. what to do") unless the bytes
    of `path` match its digest file. Call before any HDF5 parsing."""
    if (found := problem(path)) and found[0] == "corrupt":
        raise CorruptCheckpoint(message(path, *found), found[1])
    if found:
        raise (CheckpointUsageError if found[0] in ("missing", "foreign") else CheckpointError)(message(path, *found))


def resolve(target: str) -> str:
    """The checkpoint file `target` names: a file as is; a `latest` pointer file: the checkpoint it
    names; a run directory (--out) or its checkpoints directory: the checkpoint its `latest`
    names, or the newest complete one if there is no pointer. What `target` is: capstone.flags.paths."""
    if not os.path.isdir(target):
        return _pointed(os.path.dirname(target) or ".") if paths.kind(target) is paths.Kind.POINTER else target
    directory = sub if os.path.isdir(sub := os.path.join(target, "checkpoints")) else target
    path = _pointed(directory) or next(reversed([p for _, p in files.complete_checkpoints(directory)]), None)
    if path is None:
        raise CheckpointUsageError(f"{target} is a directory without checkpoints (no {files.POINTER} pointer, no "
                                   f"ckpt-*.h5 in {directory}): the run wrote no checkpoint yet, or it is not a "
                                   f"run's. Pass a ckpt-*.h5 file, a run directory (--out) or its "
                                   f"checkpoints/{files.POINTER}, or train with --ckpt-every K first.")
    return path


def _pointed(directory: str) -> str | None:
    try:
        return files.read_pointer(directory)
    except (ValueError, OSError) as exc:
        raise CheckpointError(str(exc)) from None
