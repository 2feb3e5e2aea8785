"""What the memory tier (--memory-tier, capstone.checkpoint.tier) costs and how fast it recovers, on two
network-namespace hosts (scripts/hosts, prefix CAPSTONE_HOSTS_PREFIX, default `bch`: apart from the tests').

  python -m benchmarks.tier runs     [--preset medium] [--steps 12] [--repeats 3]
  python -m benchmarks.tier recovery [--preset medium] [--kill-at 6]
  python -m benchmarks.tier parts    [--preset medium]

`runs`: 2 hosts x 1 rank, each repeat the runs without the tier, with it every step and every 4 steps, in an
order that alternates between repeats; disk checkpoints only at the last step in all of them. A run's wall
time is from its "start" row to its summary.json; its job CPU is the CPU time of every process of the job
(mpirun, the remote daemon, the ranks: all descendants of this process). Prints each run, then the median
ratios over the run without the tier, and the tier's bytes per rank.

`recovery`: under scripts/launch with the tier every step, on 2 hosts x 1 rank and 2 hosts x 2 ranks: h2 is
killed (`scripts/hosts kill h2`: its processes, its memory, its link) after step --kill-at; the job relaunches
itself on h1. Prints the time from the kill to the next completed step, the steps recomputed and the step the
run resumed from.

`parts`: what one rank's file at 2 ranks costs, apart: the copy of the rows into a tmpfs file (mapped, its
blocks reserved), their CRC-32, and the send of the file from h1 to h2 (Isend/Irecv, as the tier's copy: there
it overlaps the next step, here it is waited for), medians of 5.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.ckpt import load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "scripts", "hosts")
MODES = {"none": [], "every 1": ["--memory-tier", "1"], "every 4": ["--memory-tier", "4"]}


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
             CAPSTONE_HOSTS_PREFIX=os.environ.get("CAPSTONE_HOSTS_PREFIX", "bch"),
             CAPSTONE_HOSTS_NET=os.environ.get("CAPSTONE_HOSTS_NET", "10.213.3"), PYTHONPATH=ROOT,
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    e["CAPSTONE_HOST_PROBE"] = f"bash {HOSTS} rsh {{host}} true"
    return {k: v for k, v in e.items() if not k.startswith("SLURM_")}


def hosts(*args) -> None:
    subprocess.run(["bash", HOSTS, *args], env=env(), check=True, capture_output=True, text=True)


def train(out: str, args, *flags) -> list[str]:
    return [sys.executable, "-m", "capstone.train", "--out", out, "--preset", args.preset, "--steps", str(args.steps),
            "--ckpt-every", "0", "--deterministic", "--quiet", *flags]


def rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_once(args, flags: list[str], out: str) -> tuple[float, float]:
    """(wall s from the start row to summary.json, job CPU s) of one run on h1:1,h2:1."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = ["bash", HOSTS, "mpirun", "--hosts", "h1:1,h2:1", "--", *train(out, args, *flags)]
    p = subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"run failed ({' '.join(flags)}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = next(r["time"] for r in rows(out) if r.get("event") == "start")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return os.path.getmtime(os.path.join(out, "summary.json")) - started, cpu


def runs(args, work: str) -> None:
    walls, cpus = {m: [] for m in MODES}, {m: [] for m in MODES}
    for rep in range(args.repeats):
        for mode in (list(MODES) if rep % 2 == 0 else list(reversed(MODES))):
            out = os.path.join(work, f"{mode.replace(' ', '')}-{rep}")
            wall, cpu = run_once(args, MODES[mode], out)
            walls[mode].append(wall)
            cpus[mode].append(cpu)
            print(f"  repeat {rep} {mode:>8}: wall {wall:6.2f} s, job CPU {cpu:6.1f} s (load {load()})", flush=True)
    base, base_cpu = statistics.median(walls["none"]), statistics.median(cpus["none"])
    for mode in MODES:
        print(f"{mode:>8}: wall {statistics.median(walls[mode]):.2f} s = {statistics.median(walls[mode]) / base:.3f}x "
              f"none; job CPU {statistics.median(cpus[mode]):.1f} s = {statistics.median(cpus[mode]) / base_cpu:.3f}x")
    from capstone.checkpoint import tier
    from capstone.cli import parse
    from capstone.model.params import Layout
    settings = parse(["--preset", args.preset])
    shard = Layout.for_model(settings.model, 2).shard
    print(f"tier per rank at 2 ranks: a file of {tier.file_bytes(shard) / 1e6:.1f} MB (12 bytes x {shard} parameters "
          f"+ {tier.TRAILER // 1024} KiB), own and copy, at most 3 steps: {6 * tier.file_bytes(shard) / 1e6:.1f} MB")


def recovery(args, work: str) -> None:
    for per_host in (1, 2):
        out, log = os.path.join(work, f"recovery-{per_host}"), os.path.join(work, f"recovery-{per_host}.log")
        step = ["bash", HOSTS, "mpirun", "--hosts", f"h1:{per_host},h2:{per_host}", "--",
                *train(out, args, "--memory-tier", "--global-batch", str(4 * per_host * 2), "--batch-size", "4",
                       "--grad-accum", "0", "--resume", "auto", "--collective-timeout", "10")]
        with open(log, "w") as f:
            job = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "launch"), out, *step], env=env(), cwd=ROOT,
                                   stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        while not os.path.exists(os.path.join(out, "metrics.jsonl")) or \
                max([r.get("step", 0) for r in rows(out) if "event" not in r] or [0]) < args.kill_at:
            if job.poll() is not None:
                sys.exit(f"the run ended before step {args.kill_at}: {open(log).read()[-3000:]}")
            time.sleep(0.05)
        done = max(r["step"] for r in rows(out) if "event" not in r)
        killed = time.time()
        hosts("kill", "h2")
        rc = job.wait()
        hosts("heal", "h2")
        start = [r for r in rows(out) if r.get("event") == "start"][-1]
        after = min(r["time"] for r in rows(out) if "event" not in r and r["time"] > start["time"])
        print(f"2 hosts x {per_host} rank(s): h2 killed after step {done}; the job (exit {rc}) resumed on h1 from "
              f"{start['resumed_from']}, {done - start['start_step']} step(s) recomputed; the next step completed "
              f"{after - killed:.1f} s after the kill", flush=True)


SEND = """
import sys, time, numpy as np
from mpi4py import MPI
c, n = MPI.COMM_WORLD, int(sys.argv[1])
buf, times = np.ones(n, np.uint8), []
for _ in range(6):
    c.Barrier()
    t = time.perf_counter()
    (c.Isend if c.rank == 0 else c.Irecv)(buf, 1 - c.rank, 7).Wait()
    c.Barrier()
    times.append(time.perf_counter() - t)
if c.rank == 0:
    print(sorted(times[1:])[2])
"""


def parts(args, work: str) -> None:
    import zlib
    from capstone.checkpoint import tier
    from capstone.cli import parse
    from capstone.model.params import Layout
    shard = Layout.for_model(parse(["--preset", args.preset]).model, 2).shard
    rows, copy, crc = np.random.default_rng(0).random((3, shard), dtype=np.float32), [], []
    for i in range(5):
        path = os.path.join("/dev/shm", f"bench-tier-{os.getpid()}-{i}")
        t = time.perf_counter()
        m, buf = tier.mapped(path, tier.file_bytes(shard))
        np.copyto(np.ndarray((3, shard), "<f4", m), rows)
        copy.append(time.perf_counter() - t)
        t = time.perf_counter()
        zlib.crc32(buf[:-tier.TRAILER])
        crc.append(time.perf_counter() - t)
        del buf
        m.close()
        os.remove(path)
    cmd = ["bash", HOSTS, "mpirun", "--hosts", "h1:1,h2:1", "--", sys.executable, "-c", SEND, str(tier.file_bytes(shard))]
    send = float(subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()[-1])
    mb = tier.file_bytes(shard) / 1e6
    print(f"one rank's file at 2 ranks, {mb:.1f} MB: copy into the tmpfs {1e3 * statistics.median(copy):.1f} ms, "
          f"CRC-32 {1e3 * statistics.median(crc):.1f} ms, the send h1 -> h2 {1e3 * send:.1f} ms "
          f"({mb / send:.0f} MB/s over the namespace link)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("runs", "recovery", "parts"))
    p.add_argument("--preset", default="medium")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=6)
    args = p.parse_args(argv)
    print(f"load average {load()}; {args.what} at {args.preset}", flush=True)
    work = tempfile.mkdtemp(prefix="bench-tier-")
    hosts("up", "2")
    try:
        {"runs": runs, "recovery": recovery, "parts": parts}[args.what](args, work)
    finally:
        hosts("down")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
