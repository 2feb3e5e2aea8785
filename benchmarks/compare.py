"""Step time of this checkout against another revision's, on the same machine, interleaved.

  python -m benchmarks.compare --before REV [--presets medium large] [--ranks 1] [--steps 6]
                               [--repeats 3] [-- EXTRA TRAINING FLAGS]

`git archive REV capstone` gives the other code; each repeat runs both trees (in alternating
order, so drift in the machine's load hits both) with `mpirun -n RANKS python -m capstone.train
--preset P` and no checkpoints or evaluations past the first, one rank pinned to CPU 0. Prints the
median step_ms over steps 2.. of each run, the median over repeats, and now / before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unpack(rev: str, where: str) -> str:
    """The capstone package of commit `rev` into `where`, by `git archive | tar -x` (Python's tarfile
    `filter=` is missing from Debian 12's Python 3.11.2)."""
    blob = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev, "capstone"], capture_output=True,
                          check=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=blob, capture_output=True, check=True)
    return where


def step_ms(code: str, out: str, ranks: int, preset: str, steps: int, extra: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    pin = ["taskset", "-c", "0"] if ranks == 1 and shutil.which("taskset") else []
    cmd = [*pin, "mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", out,
           "--preset", preset, "--steps", str(steps), "--eval-every", str(10 * steps), "--ckpt-every", "0",
           "--ckpt-every-minutes", "0", "--warmup-steps", "0", "--quiet", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code)
    if res.returncode not in (0, 1):   # 1: an invariant of a short run; the timings are still there
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("step", 0) >= 2]
    return statistics.median(r["step_ms"] for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the git revision to compare with")
    p.add_argument("--presets", nargs="+", default=["medium", "large"])
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="more training flags, after --")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    tmp = tempfile.mkdtemp(prefix="capstone-compare-")
    try:
        os.makedirs(os.path.join(tmp, "before"))
        trees = {"before": unpack(args.before, os.path.join(tmp, "before")), "now": ROOT}
        print(f"step_ms, median over steps 2..{args.steps}; {args.ranks} rank(s); before = {args.before}, now = "
              f"this checkout; {args.repeats} interleaved repeats")
        for preset in args.presets:
            got = {"before": [], "now": []}
            for rep in range(args.repeats):
                for name in ("before", "now") if rep % 2 == 0 else ("now", "before"):
                    out = os.path.join(tmp, f"{preset}-{name}-{rep}")
                    got[name].append(step_ms(trees[name], out, args.ranks, preset, args.steps, extra))
            b, n = statistics.median(got["before"]), statistics.median(got["now"])
            print(f"  {preset:<8} before {b:9.1f} ms {got['before']}\n  {'':<8} now    {n:9.1f} ms {got['now']}  "
                  f"now/before {n / b:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
