"""Ctrl-C to saved, against Open MPI's kill sequence: this checkout against another revision's.

  python -m benchmarks.stop_margin [--before main] [--preset medium] [--ranks 2] [--repeats 5]

`git archive REV capstone` gives the other code (benchmarks.compare's `unpack`). Each repeat runs
both trees, in alternating order, as the README's plain route runs them: `mpirun -n RANKS python -m
capstone.train --preset P` with Open MPI's defaults (every OMPI_MCA_* variable removed: SIGKILL 2 s
after a Ctrl-C). After the launch's third step and a random moment up to one step more, SIGINT to
mpirun's process group (a terminal's Ctrl-C); the time until a complete checkpoint appears in the
run's checkpoints/ (polled every 5 ms), and summary.json's status. Prints one line per trial, then
per tree how many saved and the median stop-to-saved time. Not a test: figures for docs/running.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.compare import ROOT, unpack

NAME = re.compile(r"^ckpt-\d{8}\.h5$")


def plain_env(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    env.update(PYTHONPATH=code, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def steps_done(out: str) -> list:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "step" in r]
    except (OSError, ValueError):
        return []


def trial(code: str, out: str, preset: str, ranks: int, rng: random.Random) -> dict:
    """One Ctrl-C: {"saved": seconds from the SIGINT to a complete checkpoint or None, "status", "step_s"}."""
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "capstone.train", "--preset", preset,
           "--out", out]
    proc = subprocess.Popen(cmd, env=plain_env(code), cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while proc.poll() is None and len(steps_done(out)) < 3:
        time.sleep(0.02)
    step_s = statistics.median(r["step_ms"] for r in steps_done(out)[1:]) / 1000
    time.sleep(rng.uniform(0, step_s))
    t0 = time.perf_counter()
    os.killpg(proc.pid, signal.SIGINT)
    saved, ckpts = None, os.path.join(out, "checkpoints")
    while proc.poll() is None or saved is None and time.perf_counter() - t0 < 0.2:
        if saved is None and os.path.isdir(ckpts) and any(NAME.match(n) for n in os.listdir(ckpts)):
            saved = time.perf_counter() - t0
        time.sleep(0.005)
    proc.wait()
    try:
        with open(os.path.join(out, "summary.json")) as f:
            status = json.load(f)["status"]
    except (OSError, ValueError):
        status = "no summary.json"
    return {"saved": saved, "status": status, "step_s": step_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stop_margin", description=__doc__.splitlines()[0])
    p.add_argument("--before", default="main", help="the revision to compare with (git archive REV capstone)")
    p.add_argument("--preset", default="medium", help="the preset to train")
    p.add_argument("--ranks", type=int, default=2, help="mpirun -n")
    p.add_argument("--repeats", type=int, default=5, help="Ctrl-Cs per tree")
    args = p.parse_args(argv)
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="capstone-stop-") as tmp:
        os.makedirs(os.path.join(tmp, "before"))
        trees = {"before": unpack(args.before, os.path.join(tmp, "before")), "after": ROOT}
        found: dict = {name: [] for name in trees}
        print(f"{args.preset} on {args.ranks} ranks, Ctrl-C (SIGINT to mpirun's process group), Open MPI's kill "
              f"sequence: SIGKILL 2 s after it; load {os.getloadavg()[0]:.2f}")
        for i in range(args.repeats):
            for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                r = trial(trees[name], os.path.join(tmp, f"{name}-{i}"), args.preset, args.ranks, rng)
                found[name].append(r)
                saved = "nothing saved" if r["saved"] is None else f"saved {r['saved']:.2f} s after the Ctrl-C"
                print(f"  {name:6} trial {i + 1}: step {r['step_s']:.2f} s; {saved}; summary.json: {r['status']}",
                      flush=True)
        for name, rows in found.items():
            times = [r["saved"] for r in rows if r["saved"] is not None]
            median = f"median {statistics.median(times):.2f} s" if times else "-"
            print(f"{name:6} ({args.before if name == 'before' else 'this checkout'}): {len(times)}/{len(rows)} saved, "
                  f"{median} from Ctrl-C to saved; {sum(r['status'] == 'preempted' for r in rows)} summary.json "
                  f"'preempted'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
