"""What checkpoints cost: the wall time of runs saving every step (asynchronous and synchronous) over
the same run without periodic checkpoints, and the save's own throughput against the disk's.

  python -m benchmarks.ckpt runs  [--preset medium] [--ranks 2] [--steps 12] [--repeats 2] [--dir DIR]
  python -m benchmarks.ckpt write [--preset medium] [--ranks 2] [--saves 5] [--dir DIR]

`runs`: each repeat launches the three runs in an order that alternates between repeats (none,
async, sync; then sync, async, none; ...): `--ckpt-every 0 --eval-every 1` (the last step's
checkpoint only, and the held-out evaluation every step that a checkpoint every step also makes: a
checkpoint is always of a judged state), `--ckpt-every 1` with --ckpt-async (the default) and with
--no-ckpt-async. A run's wall time is from
its "start" row (training begins: the interpreter, MPI and the start-up are left out) to its
summary.json (the last write waited for, invariant (d) checked), so every checkpoint is in it.
Prints each run and the median ratios over `none`.

`write`: on RANKS ranks (mpirun), the synchronous save (`capstone.checkpoint.save`) of a random
optimizer state of the preset's size into DIR, SAVES times: the median seconds and MB/s of the
whole save, and of its parts measured apart: the digests (each dataset's sha256 and the logical
digests, on every rank: the CPU floor of a save, also paid by a background write on busy cores).
Then `dd bs=1M count=200 conv=fsync` into the same directory: the disk's sequential write with
fsync, and the save's share of it. Prints the machine's load average first: other processes
sharing the cores change every figure here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# every checkpoint is of an evaluated state (capstone.checkpoint.cadence): `none` evaluates every step too
MODES = {"none": ["--ckpt-every", "0", "--eval-every", "1"], "async": ["--ckpt-every", "1", "--ckpt-async"],
         "sync": ["--ckpt-every", "1", "--no-ckpt-async"]}
MB = 1e6


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if os.geteuid() == 0:
        e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return e


def mpirun(ranks: int) -> list[str]:
    return ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable]


def run_once(args, mode: str, out: str) -> tuple[float, float, float]:
    """One run: seconds from its start row to its summary.json, its median step row (ms; the steps'
    own time, without a synchronous save, with the CPU a background write takes from them), and the
    CPU seconds (user + system) of the whole job, every rank and thread: what load cannot change."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = mpirun(args.ranks) + ["-m", "capstone.train", "--preset", args.preset, "--steps", str(args.steps),
                                "--out", out, "--quiet", *MODES[mode]]
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = list(map(json.loads, f))
    started = next(r["time"] for r in rows if r.get("event") == "start")
    step_ms = statistics.median(r["step_ms"] for r in rows if "step" in r and r["step"] > 1)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return os.path.getmtime(os.path.join(out, "summary.json")) - started, step_ms, cpu


def runs(args) -> None:
    print(f"{args.preset} on {args.ranks} ranks, {args.steps} steps; load average before: {load()}")
    walls: dict = {m: [] for m in MODES}
    steps: dict = {m: [] for m in MODES}
    cpus: dict = {m: [] for m in MODES}
    order = list(MODES)
    for rep in range(args.repeats):
        for mode in (order if rep % 2 == 0 else order[::-1]):
            out = os.path.join(args.dir, f"{mode}-{rep}")
            wall, step_ms, cpu = run_once(args, mode, out)
            walls[mode].append(wall)
            steps[mode].append(step_ms)
            cpus[mode].append(cpu)
            print(f"  repeat {rep} {mode:>5}: {wall:7.2f} s, median step row {step_ms:7.1f} ms, job CPU {cpu:6.1f} s",
                  flush=True)
            shutil.rmtree(out, ignore_errors=True)
    base, base_cpu = statistics.median(walls["none"]), statistics.median(cpus["none"])
    for mode in MODES:
        print(f"{mode:>5}: median {statistics.median(walls[mode]):7.2f} s = "
              f"{statistics.median(walls[mode]) / base:.3f}x none  ({' '.join(f'{w:.2f}' for w in walls[mode])}); "
              f"step rows {statistics.median(steps[mode]):.0f} ms; job CPU {statistics.median(cpus[mode]):.1f} s = "
              f"{statistics.median(cpus[mode]) / base_cpu:.3f}x none")
    print(f"load average after: {load()}")


def dd(directory: str) -> float:
    """MB/s of `dd bs=1M count=200 conv=fsync` into `directory`."""
    path = os.path.join(directory, "dd.bin")
    res = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=200", "conv=fsync"],
                         capture_output=True, text=True)
    os.remove(path)
    found = re.search(r"(\d+) bytes.*?, ([\d.]+) s,", res.stderr)
    return int(found.group(1)) / float(found.group(2)) / MB


def write(args) -> None:
    """Run `write_ranks` under mpirun, then dd in the same directory."""
    print(f"{args.preset} on {args.ranks} ranks, {args.saves} saves into {args.dir}; load average: {load()}")
    res = subprocess.run(mpirun(args.ranks) + ["-m", "benchmarks.ckpt", "write_ranks", "--preset", args.preset,
                                               "--saves", str(args.saves), "--dir", args.dir], env=env(),
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(res.stdout + res.stderr)
    got = json.loads(res.stdout.strip().splitlines()[-1])
    disk = dd(args.dir)
    mbs = got["bytes"] / got["save_s"] / MB
    print(f"  checkpoint {got['bytes'] / MB:.1f} MB; save {got['save_s']:.3f} s = {mbs:.0f} MB/s "
          f"({' '.join(f'{s:.3f}' for s in got['saves'])})")
    print(f"  digests alone {got['digest_s']:.3f} s (sha256 + logical digests, per rank: the CPU floor)")
    print(f"  dd bs=1M count=200 conv=fsync, same directory: {disk:.0f} MB/s; the save is {mbs / disk:.0%} of it")
    print(f"load average after: {load()}")


def write_ranks(args) -> None:
    """Under mpirun: time `args.saves` synchronous saves and the digests apart; rank 0 prints JSON."""
    import numpy as np

    from capstone import checkpoint
    from capstone.checkpoint.digest import distributed_roots, sha256_hex
    from capstone.collective import launch
    from capstone.config import ModelConfig
    from capstone.model.params import Layout
    from capstone.flags.presets import PRESETS
    from capstone.step.state import ROWS, ShardState
    world = launch.world()
    fields = ModelConfig.__dataclass_fields__
    layout = Layout.for_model(ModelConfig(**{k: v for k, v in PRESETS[args.preset].items() if k in fields}), world.size)
    rng = np.random.default_rng(world.rank)
    state = ShardState(*(rng.standard_normal(layout.shard, dtype=np.float32) for _ in ROWS), t=1)
    saves, digests = [], []
    for i in range(args.saves):
        world.Barrier()
        t0 = time.perf_counter()
        man = checkpoint.save(world, args.dir, i + 1, state, layout, {}, keep_last=1)
        world.Barrier()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        data = np.stack(state.rows())
        sha256_hex(data)
        distributed_roots(world, dict(zip(ROWS, data)), world.rank * layout.shard, layout.n_params)
        digests.append(time.perf_counter() - t0)
    if world.rank == 0:
        print(json.dumps({"bytes": man["bytes"], "save_s": statistics.median(saves), "saves": saves,
                          "digest_s": statistics.median(digests)}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("runs", "write", "write_ranks"), help="runs: wall times; write: the save's MB/s")
    p.add_argument("--preset", default="medium", help="model preset (default: medium)")
    p.add_argument("--ranks", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--steps", type=int, default=12, help="runs: steps of each run (default: 12)")
    p.add_argument("--repeats", type=int, default=2, help="runs: launches of each mode (default: 2)")
    p.add_argument("--saves", type=int, default=8, help="write: saves timed (default: 8)")
    p.add_argument("--dir", default=None, help="where to write (default: a new directory under runs/; removed after)")
    args = p.parse_args(argv)
    if args.what == "write_ranks":
        return write_ranks(args)
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench-ckpt-", dir=os.path.abspath("runs") if os.path.isdir("runs")
                                             else None)
    try:
        runs(args) if args.what == "runs" else write(args)
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
