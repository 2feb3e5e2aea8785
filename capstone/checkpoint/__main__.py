"""`python -m capstone.checkpoint inspect|verify|seal TARGET`: serial checkpoint tools (no mpirun).

TARGET is a ckpt-*.h5 file, a run directory (--out), its checkpoints directory or a `latest`
pointer (the last three mean the checkpoint `latest` names). verify and inspect first check the
file's size and sha256 against its digest file (ckpt-*.h5.sha256) before HDF5 parses anything,
then recompute every sha256 inside (metadata, attributes, each dataset, the logical digests);
inspect prints the manifest and only the failed checks, verify prints every check.
`inspect --json` prints one JSON object on stdout (the metadata plus "file", "verified",
"problems"; or "file", "verified": false, "error"); `verify --json` prints "file", "verified",
"step", "world_size", "checks" (each {"ok", "check"}) and "problems"; messages go to stderr.
seal writes the digest file of a checkpoint that has none (written before digest files existed)
after `verify --unsealed` passed in a child process.
Exit codes: 0 verified (sealed); 1 a check failed or the file is not a valid checkpoint; 2 a usage
mistake (a TARGET that does not exist, holds no checkpoint, or is a model's weights or a dataset: what
TARGET is, capstone.flags.paths decides; a bad option).
"""

import argparse
import hashlib
import json
import subprocess
import sys

import numpy as np

from capstone.checkpoint import integrity, kept
from capstone.checkpoint.files import DIGEST_SUFFIX, CheckpointError, CheckpointUsageError
from capstone.checkpoint.serial import checks, find, load_all
from capstone.flags.pipe import run_tool
from capstone.step.state import ROWS


def manifest(path: str, meta: dict) -> None:
    print(f"{path}: capstone checkpoint v{meta['format_version']}, step {meta['step']}, "
          f"{meta['world_size']} ranks, {meta['n_params']} parameters (padded {meta['padded']}), "
          f"Adam step {meta['adam_t']}, data cursor {meta.get('run', {}).get('data_cursor')}")
    print(f"  model {json.dumps(meta.get('model_config'), sort_keys=True)}")
    modes = meta.get("modes")   # what a --resume without mode flags keeps (capstone.checkpoint.kept)
    print("  modes " + (", ".join(f"{k} {kept.shown(k, modes[k])}" for k in kept.KEPT if k in modes) if modes else
                        "none recorded (written before the modes were kept: a resume takes the flags' defaults)"))
    for name, info in sorted(meta["datasets"].items()):
        print(f"  /{name}  ({len(ROWS)}, {info['length']}) float32  offset {info['offset']}  sha256 {info['sha256']}")
    for row, root in meta["logical_sha256"].items():
        print(f"  logical {row:<11} {root}")


def fingerprints(meta: dict, results: dict) -> str:
    """The stored parameters' fingerprints, to compare with a run's metrics.jsonl: --deterministic's (the canonical
    vector's chunks, capstone.parallel.chunksums) and the older kind's (sha256 of the vector: --deterministic before
    issue 49 on one rank or data-parallel layouts, and the default mode on one rank)."""
    from capstone.parallel.chunksums import whole
    master = np.concatenate([data[ROWS.index("master")] for _, _, data in results.values()])[:meta["n_params"]]
    return (f"  fingerprints of the parameters: {whole(master)[1]} (--deterministic, the canonical vector's chunks), "
            f"{hashlib.sha256(master.tobytes()).hexdigest()[:16]} (sha256 of the vector: the older kind)")


def failed(args, error: str, code: int) -> int:
    """Say that TARGET could not be read (on stdout too as JSON for inspect/verify --json); return `code`."""
    if args.json and args.command != "seal":
        print(json.dumps({"file": args.target, "verified": False, "error": error}, indent=2))
    print(f"error: {error}", file=sys.stderr)
    return code


def inspect_or_verify(args, path: str) -> int:
    try:
        meta, results = load_all(path, require_digest=not args.unsealed)
    except CheckpointError as exc:
        return failed(args, str(exc), 1)
    lines = checks(path, meta, results, sealed=not args.unsealed)
    ok = all(good for good, _ in lines)
    problems = [line for good, line in lines if not good]
    if args.json and args.command == "verify":
        print(json.dumps({"file": path, "verified": ok, "step": meta.get("step"), "world_size": meta.get("world_size"),
                          "checks": [{"ok": good, "check": line} for good, line in lines], "problems": problems},
                         indent=2))
    elif args.json:
        print(json.dumps({**meta, "file": path, "verified": ok, "problems": problems}, indent=2, sort_keys=True))
    elif args.command == "inspect":
        manifest(path, meta)
        if ok:
            print(fingerprints(meta, results))
    out = sys.stderr if args.json else sys.stdout
    for line in [line for _, line in lines] if args.command == "verify" else problems:
        print(line, file=out)
    print(f"{path}: {'verified' if ok else 'FAILED verification'}", file=out)
    return 0 if ok else 1


def seal(path: str) -> int:
    """Write the digest file of a checkpoint that has none, once `verify --unsealed` passed in a
    child process (parsing unverified bytes may crash it; this process stays clean)."""
    if (found := integrity.problem(path)) is None:
        print(f"{path}: already sealed: its digest file {path}{DIGEST_SUFFIX} matches")
        return 0
    if found[0] != "unsealed":
        print(f"error: not sealing: {integrity.message(path, *found)}", file=sys.stderr)
        return 1
    if code := subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", "--unsealed", path]).returncode:
        how = f"killed by signal {-code}" if code < 0 else f"exit {code}"
        print(f"error: not sealing {path}: verify --unsealed failed ({how}); the file is damaged or not a "
              f"capstone checkpoint. Set it aside (mv {path} {path}.corrupt) and resume from another checkpoint: "
              f"--resume auto then takes the newest one that verifies.", file=sys.stderr)
        return 1
    integrity.write_digest(path)
    print(f"{path}: sealed: wrote {path}{DIGEST_SUFFIX}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m capstone.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("inspect", "verify", "seal"),
                   help="inspect: print the manifest; verify: check every digest; seal: add a missing digest file")
    p.add_argument("target", metavar="TARGET",
                   help="a ckpt-*.h5 file, a run directory (--out), its checkpoints directory or a latest pointer")
    p.add_argument("--json", action="store_true", help="inspect, verify: print one JSON object on stdout")
    p.add_argument("--unsealed", action="store_true", help="check a file that has no digest file (HDF5 then parses "
                   "unverified bytes: a damaged file can crash this process; seal runs it in a child process)")
    args = p.parse_args(argv)
    try:   # a mistyped path, a model's weights, a dataset: a usage mistake (exit 2), as for sample and export
        path = find(args.target, "checkpoint", CheckpointUsageError)
    except CheckpointError as exc:   # also a directory without checkpoints (2); a bad `latest` is 1
        return failed(args, str(exc), 2 if isinstance(exc, CheckpointUsageError) else 1)
    return seal(path) if args.command == "seal" else inspect_or_verify(args, path)


if __name__ == "__main__":
    sys.exit(run_tool(main))
