"""`python -m benchmarks.tp_split RUN_DIR ...`: the per-step time split of --tp runs (rank 0's clock).

compute = forward+backward minus the f/g allreduces inside it; tp_allreduce = those allreduces
(including the wait for the slowest TP rank; their calls and summed bytes per step too); then the
DP reduce-scatter, Adam, the allgather.
Steps 2.. of every run (step 1 pays one-off warm-up); median ms.
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def split(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = {r["step"]: r for r in map(json.loads, f) if "step" in r}
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    keep = [{**r, "compute_ms": r["fwd_bwd_ms"] - r.get("tp_allreduce_ms", 0.0)}
            for step, r in sorted(rows.items()) if step >= 2]
    med = lambda key: statistics.median(r.get(key, 0.0) for r in keep)   # noqa: E731
    tp = [r["comm"]["tp_allreduce"] for r in keep if "tp_allreduce" in r.get("comm", {})]
    return {"world": s["world_size"], "padded": s["padded"], "compute": med("compute_ms"),
            "tp_MB": tp[-1]["bytes"] / 2**20 if tp else 0.0, "tp_calls": tp[-1]["calls"] if tp else 0,
            "tp_allreduce": med("tp_allreduce_ms"), "reduce_scatter": med("reduce_scatter_ms"),
            "adam": med("optimizer_ms"), "allgather": med("allgather_ms"), "step": med("step_ms")}


def main(argv: list[str]) -> None:
    cols = ("compute", "tp_allreduce", "reduce_scatter", "adam", "allgather", "step")
    print(f"{'run':<10} {'slice padded':>12} {'TP calls, MiB/step':>19} " + " ".join(f"{c:>14}" for c in cols))
    for d in argv:
        s = split(d)
        print(f"{os.path.basename(d.rstrip('/')):<10} {s['padded']:>12} {s['tp_calls']:>8} {s['tp_MB']:>10.2f} "
              + " ".join(f"{s[c]:>14.3f}" for c in cols))


if __name__ == "__main__":
    main(sys.argv[1:])
