"""Reading a checkpoint file: the format's constants and the checks every reader makes.

These functions parse HDF5, so they run only on a file whose bytes `integrity.check_file` matched
against its digest file; `open_verified` (for serial readers: verify, inspect, a sampler) does
both. Inside the file, /meta_json is authoritative (its sha256 is the root attribute
`meta_sha256`); every other attribute must equal what /meta_json says, so each one is covered by
a digest: the root attributes, and each shard dataset's rank, offset, length and sha256.
"""

import contextlib
import hashlib
import json

import h5py
import numpy as np

from capstone.checkpoint import integrity
from capstone.checkpoint.digest import sha256_hex
from capstone.checkpoint.files import CheckpointError, CorruptCheckpoint
from capstone.step.state import ROWS

FORMAT = "capstone-checkpoint"
VERSION = 2
HEADER = ("format", "format_version", "step", "world_size", "n_params", "padded", "shard", "adam_t")
DATASET_KEYS = ("rank", "offset", "length", "sha256")


def dataset_name(rank: int) -> str:
    return f"shards/rank{rank:05d}"


def root_attributes(meta: dict) -> dict:
    """Readable copies (h5ls/h5dump) of the header as root attributes; /meta_json, covered by
    meta_sha256, is the authoritative copy and loading checks that the two agree."""
    return {**{key: meta[key] for key in HEADER}, "rows": ",".join(meta["rows"])}


def silence_hdf5() -> None:
    """No HDF5 error stack on stderr: our message says what failed. h5py does this on import for
    the importing thread; repeat it for the calling one."""
    with contextlib.suppress(ImportError):  # a future h5py without it
        from h5py._errors import silence_errors
        silence_errors()


def corrupt(path: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(integrity.message(path, "corrupt", reason), reason)


def read_error(path: str, exc: BaseException, where: str = "") -> CheckpointError:
    """A reader's failure as a clean error: a CheckpointError as it is, any exception from h5py/numpy/json
    as a CorruptCheckpoint naming the file (`where`: e.g. " on rank 3")."""
    if isinstance(exc, CheckpointError):
        return exc
    text = (str(exc).splitlines() or [""])[0][:200]
    return corrupt(path, f"it cannot be read{where} ({type(exc).__name__}: {text})")


def read_meta(f, path: str) -> dict:
    """Check the format marker, the metadata digest and every attribute outside the shard
    datasets against it; return the metadata (serial or collective)."""
    if f.attrs.get("format") != FORMAT:
        raise CheckpointError(f"not a valid checkpoint: {path} is an HDF5 file but not a capstone checkpoint (no "
                              f"format={FORMAT!r} attribute); pass a ckpt-*.h5 file written by capstone.")
    if not isinstance(ds := f.get("meta_json"), h5py.Dataset) or ds.ndim != 1 or ds.dtype != np.uint8:
        raise corrupt(path, "dataset /meta_json is missing or malformed: the file is incomplete or damaged")
    raw, stored = ds[...], f.attrs.get("meta_sha256")
    if sha256_hex(raw) != stored:
        raise corrupt(path, f"/meta_json sha256 mismatch (stored {stored}, computed {sha256_hex(raw)}): "
                            f"the checkpoint metadata is corrupt")
    meta = json.loads(raw.tobytes())
    if meta.get("format_version") != VERSION or meta.get("rows") != list(ROWS):
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')} with rows {meta.get('rows')} "
                              f"is not what this capstone reads (version {VERSION}, rows {list(ROWS)}); "
                              f"resume it with the capstone version that wrote it.")
    # the root attributes are exactly the header copies and meta_sha256; no other object outside the shards has any
    _check_attrs(path, f.attrs, {**root_attributes(meta), "meta_sha256": stored}, "root ")
    for name in ("meta_json", "shards"):
        if name in f and len(f[name].attrs):
            raise corrupt(path, f"/{name} has attributes {sorted(f[name].attrs)}, which a checkpoint never has")
    _check_layout(path, meta)
    return meta


def _check_attrs(path: str, attrs, want: dict, prefix: str = "", suffix: str = "") -> None:
    """An HDF5 object's attributes are exactly `want` (what the verified /meta_json says)."""
    for key in sorted(set(want) | set(attrs)):
        # a numpy scalar as a plain value
        stored = value.item() if isinstance(value := attrs.get(key), np.generic) else value
        if stored != want.get(key):
            raise corrupt(path, f"{prefix}attribute {key}={stored!r}{suffix} disagrees with the verified /meta_json "
                                f"({want.get(key)!r}); the file was modified")


def _check_layout(path: str, meta: dict) -> None:
    """/meta_json's dataset table is the one `save` writes: rank r holds [r*shard, (r+1)*shard)."""
    shard, world = meta["shard"], meta["world_size"]
    if sorted(meta["datasets"]) != [dataset_name(r) for r in range(world)]:
        raise corrupt(path, f"/meta_json lists datasets {sorted(meta['datasets'])} for {world} ranks")
    for r in range(world):
        info = meta["datasets"][dataset_name(r)]
        if {k: info.get(k) for k in DATASET_KEYS[:3]} != {"rank": r, "offset": r * shard, "length": shard}:
            raise corrupt(path, f"/meta_json describes /{dataset_name(r)} as {info}, not rank {r}'s shard")


def checked_dataset(f, path: str, meta: dict, name: str, reader: str) -> h5py.Dataset:
    """The shard dataset `name`, its shape, dtype and attributes checked against /meta_json."""
    if (info := meta["datasets"].get(name)) is None or name not in f:
        raise corrupt(path, f"dataset /{name} is missing (needed by {reader}): the file is incomplete")
    want = (len(ROWS), info["length"])
    if not isinstance(ds := f[name], h5py.Dataset) or ds.shape != want or ds.dtype != np.dtype("<f4"):
        got = f"{ds.shape} {ds.dtype}" if isinstance(ds, h5py.Dataset) else "not a dataset"
        raise corrupt(path, f"/{name} is {got}, expected a float32 dataset of shape {want} (read by {reader})")
    _check_attrs(path, ds.attrs, {key: info.get(key) for key in DATASET_KEYS}, suffix=f" of /{name}")
    return ds


def read_dataset(f, path: str, meta: dict, name: str, reader: str) -> np.ndarray:
    """Read one shard dataset whole and verify its shape, attributes and sha256 against the metadata."""
    data = checked_dataset(f, path, meta, name, reader)[...]
    _check_sha256(path, name, sha256_hex(data), meta["datasets"][name]["sha256"], f" read by {reader}")
    return data


def _check_sha256(path: str, name: str, digest: str, stored: str, by: str = "") -> None:
    """`digest` (of shard dataset `name`'s bytes) is `stored`, the one /meta_json records."""
    if digest != stored:
        raise corrupt(path, f"dataset /{name} sha256 mismatch (stored {stored}, computed {digest}){by}: the shard is "
                            f"corrupt")


def open_verified(path: str, require_digest: bool = True):
    """For serial readers (verify, inspect, a sampler): call first. `path` may be a ckpt-*.h5 file,
    a run directory or a `latest` pointer. Checks the file's bytes against its digest file, then
    opens it with h5py and checks the header. Returns (h5py.File, meta); the caller closes the
    file. Raises CheckpointError ("not a valid checkpoint: FILE: reason. what to do")."""
    path = integrity.resolve(path)
    if require_digest:
        integrity.check_file(path)
    silence_hdf5()
    f = None
    try:
        f = h5py.File(path, "r")
        return f, read_meta(f, path)
    except Exception as exc:
        if f is not None:
            f.close()
        raise read_error(path, exc) from None


def verify_contents(path: str) -> dict:
    """Serial: `open_verified` plus every shard's sha256, streamed a slice at a time (memory
    bounded). For a checkpoint whose bytes were damaged before its digest file was written."""
    f, meta = open_verified(path)
    with f:
        try:
            for name in sorted(meta["datasets"]):
                ds = checked_dataset(f, path, meta, name, "verify")
                h, step = hashlib.sha256(), 1 << 22
                for row in range(ds.shape[0]):
                    for a in range(0, ds.shape[1], step):
                        h.update(np.ascontiguousarray(ds[row, a:a + step]))
                _check_sha256(path, name, h.hexdigest(), meta["datasets"][name]["sha256"])
        except Exception as exc:
            raise read_error(path, exc) from None
    return meta
