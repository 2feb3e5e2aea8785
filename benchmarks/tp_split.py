"""`python -m benchmarks.tp_split RUN_DIR ...`: the per-step time split of --tp runs (rank 0's clock).

compute = forward+backward minus the f/g allreduces inside it; tp_allreduce = those allreduces
(including the wait for the slowest TP rank, and the held-out forward's on evaluation steps; their
calls and summed bytes per step too); then the DP reduce-scatter, Adam, the allgather.
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
    keep = [r for step, r in sorted(rows.items()) if step >= 2]

    def med(get):
        return statistics.median(get(r) for r in keep)

    def comm_ms(r, kind):
        return r.get("comm", {}).get(kind, {}).get("ms", 0.0)
    tp = [r["comm"]["tp_allreduce"] for r in keep if "tp_allreduce" in r.get("comm", {})]
    return {"world": s["world_size"], "padded": s["padded"],
            "compute": med(lambda r: r["fwd_bwd_ms"] - comm_ms(r, "tp_allreduce")),
            "tp_MB": tp[-1]["bytes"] / 2**20 if tp else 0.0, "tp_calls": tp[-1]["calls"] if tp else 0,
            "tp_allreduce": med(lambda r: comm_ms(r, "tp_allreduce")),
            "reduce_scatter": med(lambda r: comm_ms(r, "reduce_scatter")),
            "adam": med(lambda r: r["optimizer_ms"] - comm_ms(r, "allgather")),
            "allgather": med(lambda r: comm_ms(r, "allgather")), "step": med(lambda r: r["step_ms"])}


def main(argv: list[str]) -> None:
    cols = ("compute", "tp_allreduce", "reduce_scatter", "adam", "allgather", "step")
    print(f"{'run':<10} {'slice padded':>12} {'TP calls, MiB/step':>19} " + " ".join(f"{c:>14}" for c in cols))
    for d in argv:
        s = split(d)
        print(f"{os.path.basename(d.rstrip('/')):<10} {s['padded']:>12} {s['tp_calls']:>8} {s['tp_MB']:>10.2f} "
              + " ".join(f"{s[c]:>14.3f}" for c in cols))


if __name__ == "__main__":
    main(sys.argv[1:])
