"""`python -m capstone.checkpoint inspect|verify FILE`: serial checkpoint tools (no mpirun needed).

Both recompute every sha256 (metadata, each dataset, the logical digests) and exit 0 only if all
match; inspect prints the manifest and only the failed checks, verify prints every check.
Exit codes: 0 verified; 1 a digest failed or the file is unreadable / not a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

import h5py
import numpy as np

from . import CheckpointError, ROWS, read_meta, read_dataset
from .digest import logical_root


def load_all(path: str):
    """Read and check the metadata; return (meta, {dataset: (ok, message, array|None)})."""
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"cannot open {path}: {exc}; the file is truncated or not HDF5") from None
    with f:
        meta = read_meta(f, path)
        results = {}
        for name in sorted(meta["datasets"]):
            try:
                results[name] = (True, "sha256 ok", read_dataset(f, path, meta, name, "verify"))
            except CheckpointError as exc:
                results[name] = (False, str(exc), None)
    return meta, results


def logical_check(meta: dict, results: dict) -> dict:
    """Recompute the logical digests from the concatenated shards."""
    names = sorted(meta["datasets"], key=lambda n: meta["datasets"][n]["offset"])
    if not all(results[n][0] for n in names):
        return {row: None for row in ROWS}
    full = np.concatenate([results[n][2] for n in names], axis=1)[:, :meta["n_params"]]
    return {row: logical_root(full[i], meta["logical_chunk"]) == meta["logical_sha256"][row] for i, row in enumerate(ROWS)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m capstone.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("inspect", "verify"), help="inspect: print the manifest; verify: check every digest")
    p.add_argument("file", help="a ckpt-*.h5 file")
    p.add_argument("--json", action="store_true", help="print the metadata as JSON (inspect)")
    args = p.parse_args(argv)
    try:
        meta, results = load_all(args.file)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.command == "inspect" and args.json:
        print(json.dumps(meta, indent=2, sort_keys=True))
    elif args.command == "inspect":
        print(f"{args.file}: capstone checkpoint v{meta['format_version']}, step {meta['step']}, "
              f"{meta['world_size']} ranks, {meta['n_params']} parameters (padded {meta['padded']}), "
              f"Adam step {meta['adam_t']}, data cursor {meta.get('run', {}).get('data_cursor')}")
        print(f"  model {json.dumps(meta.get('model_config'), sort_keys=True)}")
        for name, info in sorted(meta["datasets"].items()):
            print(f"  /{name}  ({len(ROWS)}, {info['length']}) float32  offset {info['offset']}  sha256 {info['sha256']}")
        for row, root in meta["logical_sha256"].items():
            print(f"  logical {row:<11} {root}")
    return verify(args.file, meta, results, quiet=args.command == "inspect")


def verify(path: str, meta: dict, results: dict, quiet: bool) -> int:
    """Print the result of every digest check (only failures when quiet); 0 if all match, else 1."""
    ok = True
    lines = ["ok  /meta_json: sha256 ok (step, config, layout, cursor, Adam step, digests)"]
    for name, (good, message, _) in results.items():
        ok &= good
        lines.append(f"{'ok ' if good else 'BAD'} /{name}: {message}")
    for row, good in logical_check(meta, results).items():
        ok &= bool(good)
        lines.append(f"{'ok ' if good else 'BAD'} logical {row}: "
                     f"{'matches' if good else 'not checked' if good is None else 'MISMATCH'}")
    for line in lines:
        if not quiet or not line.startswith("ok"):
            print(line)
    print(f"{path}: {'verified' if ok else 'FAILED verification'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
