"""One process reads a whole checkpoint with serial h5py, no MPI (`python -m capstone.checkpoint`,
`capstone.sample`, `capstone.export`, `--init-from`): `find` the file a path names,
`load_all` its datasets (each checked against its digest), `checks` (verify's list), and
`load_weights`: the model config and the float32 parameters of a checkpoint that passes every check.
Errors: ConfigError for a path that names no checkpoint, CheckpointError for an invalid one.
"""

import json

import numpy as np

from capstone.flags import paths
from capstone.checkpoint import integrity
from capstone.checkpoint.digest import logical_root
from capstone.checkpoint.files import DIGEST_SUFFIX, CheckpointError, CorruptCheckpoint
from capstone.checkpoint.reader import open_verified, read_dataset, read_error
from capstone.config import ConfigError, ModelConfig
from capstone.model.params import Layout
from capstone.step.state import ROWS


def find(target: str, flag: str, error=ConfigError) -> str:
    """The checkpoint file `target` names (`integrity.resolve`: itself, or the one a run directory's
    `latest` names), once `flag` takes what it is (capstone.flags.paths): `error` for a path that names no
    checkpoint, CheckpointError for a `latest` that names no checkpoint file."""
    paths.refuse(flag, target, error)
    return integrity.resolve(target)


def load_all(path: str, require_digest: bool = True):
    """Check the file and the metadata; return (meta, {dataset: (ok, message, array|None)}) in rank order, which
    is offset order (`reader.read_meta` checked the layout)."""
    f, meta = open_verified(path, require_digest)
    with f:
        results = {}
        for name in sorted(meta["datasets"]):
            try:
                results[name] = (True, "sha256 ok", read_dataset(f, path, meta, name, "verify"))
            except Exception as exc:
                results[name] = (False, str(read_error(path, exc)), None)
    return meta, results


def logical_check(meta: dict, results: dict) -> dict:
    """Recompute the logical digests from the concatenated shards (`load_all`'s results, in offset order)."""
    if not all(good for good, _, _ in results.values()):
        return {row: None for row in ROWS}
    full = np.concatenate([data for _, _, data in results.values()], axis=1)[:, :meta["n_params"]]
    return {row: logical_root(full[i], meta["logical_chunk"]) == meta["logical_sha256"][row] for i, row in enumerate(ROWS)}


def checks(path: str, meta: dict, results: dict, sealed: bool) -> list[tuple[bool, str]]:
    """(ok, line) for every check, in order."""
    lines = [(True, f"ok  file: size and sha256 match {path}{DIGEST_SUFFIX}" if sealed else
              "--  file: no digest file checked (--unsealed)"),
             (True, "ok  /meta_json: sha256 ok (step, config, layout, cursor, Adam step, digests); "
                    "every attribute agrees with it")]
    lines += [(good, f"{'ok ' if good else 'BAD'} /{name}: {message}") for name, (good, message, _) in results.items()]
    return lines + [(bool(good), f"{'ok ' if good else 'BAD'} logical {row}: "
                                 f"{'matches' if good else 'not checked' if good is None else 'MISMATCH'}")
                    for row, good in logical_check(meta, results).items()]


def load_weights(path: str) -> tuple[dict, ModelConfig, np.ndarray]:
    """(metadata, model config, named float32 parameters) of a checkpoint that passes every digest check."""
    try:
        meta, results = load_all(path)
        bad = [line for good, line in checks(path, meta, results, sealed=True) if not good]  # verify's own checks
    except CorruptCheckpoint:   # its message says it all; its class says the file can be set aside
        raise
    except CheckpointError as exc:
        text = str(exc)
        raise CheckpointError(text if text.startswith("not a valid checkpoint") else f"not a valid checkpoint: {text}") from None
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"not a valid checkpoint: {path} is unreadable ({type(exc).__name__}: {exc}); "
                             f"sample from an earlier checkpoint.") from None
    if bad:
        raise CheckpointError(f"not a valid checkpoint: {path}: " + "; ".join(bad) + "\nSample from an earlier "
                             f"checkpoint; `python -m capstone.checkpoint verify {path}` lists every check.")
    flat = np.concatenate([data[0] for _, _, data in results.values()], dtype=np.float32)[:meta["n_params"]]
    try:
        cfg = ModelConfig(**meta["model_config"])
    except (ConfigError, TypeError) as exc:
        raise CheckpointError(f"{path}: model_config {meta.get('model_config')} is not one this capstone "
                             f"builds ({exc}); sample with the capstone version that wrote it.") from None
    layout = Layout.for_model(cfg, 1)
    if json.loads(layout.to_json()) != meta["layout"] or layout.padded != flat.size:
        raise CheckpointError(f"{path}: its parameter layout differs from the one capstone builds for "
                             f"{meta['model_config']}; sample with the capstone version that wrote it.")
    return meta, cfg, np.ascontiguousarray(flat)
