"""Sharded checkpoints: ONE parallel HDF5 file (h5py `mpio` driver) with a dataset per rank.

Layout of `ckpt-<step>.h5`:
  /            attrs: format, format_version, step, world_size, n_params, padded, shard, adam_t,
               rows (readable copies of /meta_json's header), meta_sha256
  /meta_json   uint8: canonical JSON of the header, the layout, per-dataset sha256, logical
               digests and the caller's run metadata (configs, `RunState`); `meta_sha256` is its
               sha256, so a flipped byte there is caught.
  /shards/rankNNNNN  float32 (3, shard): rows master, m, v of that rank's ZeRO-1 shard;
               attrs: sha256 (of the dataset's bytes), rank, offset, length (checked
               against /meta_json by every reader; see `reader`).
Next to it, `ckpt-<step>.h5.sha256` records the size and sha256 of the whole file; it is written
before the file is renamed into place and checked before HDF5 parses the file (`integrity`).
Every metadata operation is collective (all ranks create every dataset and write identical
attributes); each rank writes only its own shard's data. Loading verifies the whole-file digest
(rank 0), then every digest it uses, and reshards to any world size; errors are agreed across
ranks and raised on all of them. Serial readers call `open_verified(path)` first.
"""

import contextlib
import json
import os
import secrets

import h5py
import numpy as np

from capstone.checkpoint import files, integrity, reader
from capstone.checkpoint.digest import CHUNK, distributed_roots, sha256_hex
from capstone.checkpoint.files import MIB, CheckpointError, CheckpointUsageError, CorruptCheckpoint
from capstone.checkpoint.reader import (FORMAT, VERSION, dataset_name, open_verified, read_dataset, read_meta,
                                       root_attributes, verify_contents)
from capstone.collective.agree import agreed
from capstone.config import ModelConfig
from capstone.step.hooks import NONE
from capstone.step.state import ROWS, ShardState

__all__ = ["CheckpointError", "CorruptCheckpoint", "agree", "load", "mpi_io_available", "open_verified",
           "read_meta_file", "save", "verify_contents", "verify_snapshot", "write"]


def read_meta_file(path: str) -> dict:
    """Serial (one process): the verified metadata of checkpoint `path` (whole-file digest first)."""
    f, meta = open_verified(path)
    f.close()
    return meta


def mpi_io_available() -> bool:
    return bool(h5py.get_config().mpi)


def _open(path: str, mode: str, comm):
    """Collective: call on all ranks. Open with the mpio driver (serial h5py only for one rank)."""
    if mpi_io_available():
        with comm.blocking(f"parallel HDF5 open of {os.path.basename(path)}") as mpi:
            return h5py.File(path, mode, driver="mpio", comm=mpi)
    if comm.size == 1:
        return h5py.File(path, mode)
    raise CheckpointError("h5py has no MPI support, so ranks cannot share one checkpoint file. Rebuild it against "
                          "parallel HDF5: CC=mpicc HDF5_MPI=ON HDF5_DIR=<parallel hdf5 prefix> pip install --no-build-"
                          "isolation --no-binary=h5py h5py (scripts/setup does this), or run on one rank.")


def agree(comm, error: str | None, kind: type[CheckpointError] = CheckpointError) -> None:
    """Collective: call on all ranks. Raise `kind` on every rank if any rank had an error."""
    def check() -> None:
        if error:
            raise kind(error)
    agreed(comm, check, errors=(kind,), every=True)


def save(comm, directory: str, step: int, state: ShardState, layout, extra: dict,
         keep_last: int = 0, protect=(), hooks=NONE) -> dict:
    """Collective: call on all ranks. Write `state` (this rank's optimizer shard) and `extra`
    (JSON-able run metadata) as checkpoint `step` in `directory`, publish it atomically, move
    `latest` to it and apply retention. Returns the manifest."""
    data = np.stack(state.rows()).astype("<f4", copy=False)     # (len(ROWS), shard)
    return write(comm, directory, step, data, int(state.t), layout, extra, keep_last, protect, hooks)


def write(comm, directory: str, step: int, data: np.ndarray, adam_t: int, layout, extra: dict,
          keep_last: int = 0, protect=(), hooks=NONE) -> dict:
    """Collective: `save` of the rows `data` (len(ROWS), shard) at Adam step `adam_t`, e.g. a
    snapshot written by a background thread (capstone.checkpoint.background)."""
    rank, world, shard = comm.rank, comm.size, layout.shard
    digests = comm.allgather_json(sha256_hex(data))
    roots = distributed_roots(comm, dict(zip(ROWS, data)), rank * shard, layout.n_params)
    token = comm.bcast_json(secrets.token_hex(6) if rank == 0 else None)
    meta = {"format": FORMAT, "format_version": VERSION, "step": step, "world_size": world, "n_params": layout.n_params,
            "padded": layout.padded, "shard": shard, "layout": json.loads(layout.to_json()), "adam_t": adam_t,
            "rows": list(ROWS), "datasets": {dataset_name(r): {"rank": r, "offset": r * shard, "length": shard,
                                                               "sha256": digests[r]} for r in range(world)},
            "logical_sha256": roots, "logical_chunk": CHUNK, **extra}
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    meta_sha = sha256_hex(np.frombuffer(meta_bytes, dtype=np.uint8))
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
    need = files.estimated_size(data.nbytes * world, world, len(meta_bytes))
    agree(comm, files.space_error(directory, step, need) if rank == 0 else None)   # before any byte is written
    hooks.at("save.before_data", step)
    tmp = os.path.join(directory, files.partial_name(step, token))
    final = os.path.join(directory, files.final_name(step))
    _write_file(comm, tmp, meta, meta_bytes, meta_sha, data, step, hooks)
    comm.Barrier("checkpoint save: barrier after the write")
    hooks.at("save.before_rename", step)
    if rank == 0:   # the digest file first, then the checkpoint under its name
        integrity.publish(tmp, final, between=lambda: hooks.at("publish.between_renames", step))
    comm.Barrier("checkpoint save: barrier after the publish")
    hooks.at("save.before_pointer", step)
    if rank == 0:
        files.write_pointer(directory, os.path.basename(final))
    removed, size = comm.bcast_json([files.retain(directory, keep_last, protect), os.path.getsize(final)]
                                    if rank == 0 else None)
    return {"path": final, "step": step, "world_size": world, "bytes": size, "meta_sha256": meta_sha,
            "datasets": meta["datasets"], "logical_sha256": roots, "removed": removed}


def _write_file(comm, tmp: str, meta: dict, meta_bytes: bytes, meta_sha: str, data: np.ndarray, step: int, hooks):
    """Collective. Write the checkpoint file `tmp` durably. Any failure (disk full, quota,
    permissions) is agreed across ranks, so no rank is left alone in a collective, and the
    partial file is discarded before CheckpointError is raised on every rank."""
    f = None
    try:
        f = _agreed(comm, step, tmp, lambda: _open(tmp, "w", comm))
        with comm.blocking(f"parallel HDF5 metadata of checkpoint step {step}"):   # every rank makes all of it
            f.attrs.update({**root_attributes(meta), "meta_sha256": meta_sha})
            meta_ds = f.create_dataset("meta_json", shape=(len(meta_bytes),), dtype="u1")
            shards = [f.create_dataset(dataset_name(r), shape=(len(ROWS), meta["shard"]), dtype="<f4")
                      for r in range(comm.size)]
            for r, ds in enumerate(shards):
                ds.attrs.update(meta["datasets"][dataset_name(r)])

        def write():
            if comm.rank == 0:
                meta_ds[...] = np.frombuffer(meta_bytes, dtype=np.uint8)
            hooks.at("save.write", step)
            shards[comm.rank][...] = data
            hooks.at("save.after_data", step)   # before the ranks agree the writes succeeded
        _agreed(comm, step, tmp, write)   # the only per-rank I/O
        _agreed(comm, step, tmp, f.flush, f"parallel HDF5 flush of checkpoint step {step}")  # MPI_File_sync: durable
        with comm.blocking(f"parallel HDF5 close of checkpoint step {step}"):
            f.close()
    except CheckpointError:
        _discard(comm, f, tmp)
        raise


def _agreed(comm, step: int, tmp: str, action, collective: str = ""):
    """Collective. Run `action` on every rank (a `collective` one under the deadline's watchdog); if
    it failed on any, raise one CheckpointError on every rank that names the ranks, the error and
    the free space."""
    def attempt():
        with comm.blocking(collective) if collective else contextlib.nullcontext():
            return action()

    def explain(failed) -> CheckpointError:
        directory = os.path.dirname(tmp)
        free = files.free_bytes(directory)
        ranks = ", ".join(str(r) for r, _ in failed)
        who = (f"rank {ranks} could not write its shard" if len(failed) == 1
               else f"ranks {ranks} could not write their shards")
        return CheckpointError(f"{who} of checkpoint step {step} to {tmp}: {failed[0][1]}"
                               f"{'' if free is None else f' ({free / MIB:.1f} MiB free there when it failed)'}. The "
                               f"partial file was removed; the previous checkpoint and 'latest' are untouched. Free "
                               f"space or fix {directory}, then continue with --resume latest.")
    # h5py: OSError for I/O, RuntimeError for a failed flush
    return agreed(comm, attempt, errors=(OSError, RuntimeError), every=True, explain=explain)


def _discard(comm, f, tmp: str) -> None:
    """Collective. Drop a failed partial file. Its blocks are freed first (truncate on rank 0):
    HDF5 flushes its metadata on close, and on a full disk that flush fails and h5py's close
    retries forever at 100% CPU; with the space back it succeeds, then the file is removed."""
    if comm.rank == 0 and os.path.exists(tmp):
        os.truncate(tmp, 0)
    comm.Barrier("checkpoint save: barrier before discarding a failed file")
    if f is not None:
        with contextlib.suppress(OSError, RuntimeError), comm.blocking("parallel HDF5 close of a failed checkpoint"):
            f.close()
    comm.Barrier("checkpoint save: barrier after discarding a failed file")
    if comm.rank == 0 and os.path.exists(tmp):
        os.remove(tmp)


ADDED_MODEL_FIELDS = ("bias", "head_bias", "tie_embeddings", "dropout")   # model settings added after checkpoints were first written


def _check_compatible(meta: dict, path: str, layout, expect: dict) -> None:
    """Refuse a checkpoint whose model or layout differs from this run's, naming the mismatch."""
    diffs = []
    for key, want in expect.items():
        have = meta.get(key)
        if key == "model_config" and isinstance(have, dict):   # written before a field existed: its default
            have = {**{k: getattr(ModelConfig(), k) for k in ADDED_MODEL_FIELDS if k in want}, **have}
        if isinstance(have, dict) and isinstance(want, dict):
            # the data identity: only the keys the checkpoint records (an older one records fewer)
            names = sorted(have) if key == "data" else sorted(set(have) | set(want))
            diffs += [f"{name} is {have.get(name)!r} in the checkpoint but {want.get(name)!r} in this run"
                      for name in names if have.get(name) != want.get(name)]
        elif have != want:
            diffs.append(f"{key} is {have!r} in the checkpoint but {want!r} in this run")
    if meta["layout"] != json.loads(layout.to_json()):
        diffs.append("parameter layout (names/shapes/offsets) differs")
    if diffs:
        raise CheckpointUsageError(f"cannot resume from {path}: incompatible with this run: {'; '.join(diffs)}. "
                              f"Use the same model flags as the run that wrote it, or start fresh without --resume.")


def _gather_shard(f, path: str, meta: dict, lo: int, hi: int, n: int, rank: int) -> np.ndarray:
    """This rank's new shard [lo, hi) assembled from the saved shards that overlap it (resharding)."""
    out = np.zeros((len(ROWS), hi - lo), dtype=np.float32)
    old, end = meta["shard"], min(hi, n)
    for r in range(lo // old, (end - 1) // old + 1) if end > lo else ():
        data = read_dataset(f, path, meta, dataset_name(r), f"rank {rank}")
        a, b = max(lo, r * old), min(end, (r + 1) * old)
        out[:, a - lo:b - lo] = data[:, a - r * old:b - r * old]
    return out


def load(comm, path: str, layout, expect: dict) -> tuple[dict, dict]:
    """Collective: call on all ranks. Load checkpoint `path` into this rank's shard of `layout`
    (any world size), verifying the whole-file digest, every digest read and the logical digests
    after resharding. `expect` maps metadata keys to required values (e.g. the model config).
    Returns (state, meta)."""
    rank, lo, hi = comm.rank, *layout.shard_range(comm.rank)
    found = integrity.problem(path) if rank == 0 else None  # one read of the file, before HDF5 parses it
    agree(comm, integrity.message(path, *found) if found else None)
    agree(comm, None if os.path.isfile(path) else f"checkpoint {path} is not visible on rank {rank}: put --out "
                                                  f"on a file system that every node shares.")
    reader.silence_hdf5()
    comm.hooks.at("load")
    try:
        f, error = _open(path, "r", comm), None
    except Exception as exc:
        f, error = None, str(reader.read_error(path, exc, f" on rank {rank}"))
    agree(comm, error)
    state, meta, mismatch = None, None, None
    with comm.blocking(f"parallel HDF5 read of {os.path.basename(path)}"), f:
        try:
            meta = read_meta(f, path)
            _check_compatible(meta, path, layout, expect)
            state = _gather_shard(f, path, meta, lo, hi, layout.n_params, rank)
        except CheckpointUsageError as exc:   # another model than the flags ask for: exit 2
            mismatch = str(exc)
        except Exception as exc:
            error = str(reader.read_error(path, exc, f" on rank {rank}"))
    agree(comm, error)
    agree(comm, mismatch, CheckpointUsageError)
    roots = distributed_roots(comm, dict(zip(ROWS, state)), lo, layout.n_params, meta["logical_chunk"])
    bad = [r for r in ROWS if roots[r] != meta["logical_sha256"][r]]
    agree(comm, f"{path}: logical digest of {bad} differs after loading on {comm.size} ranks: the restored "
                f"state is not what was saved." if bad else None)
    return ShardState(*state, t=meta["adam_t"]), meta


def verify_snapshot(comm, path: str, layout, expect: dict, snapshot: np.ndarray) -> dict:
    """Collective: call on all ranks. Load `path` through `load` (every digest verified) and
    compare this rank's restored rows byte for byte with `snapshot` (len(ROWS), shard)."""
    try:
        state, _ = load(comm, path, layout, expect)
    except CheckpointError as exc:
        return {"ok": False, "mismatched_bytes": None, "errors": [str(exc)], "path": path}
    got = np.stack(state.rows()).astype("<f4", copy=False).view(np.uint8)
    want = np.ascontiguousarray(snapshot, dtype="<f4").view(np.uint8)
    mismatched = int(np.count_nonzero(got != want)) if got.shape == want.shape else max(got.size, want.size)
    total = sum(comm.allgather_json(mismatched))
    return {"ok": total == 0, "mismatched_bytes": total, "errors": [], "path": path}
