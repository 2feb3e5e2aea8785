"""The pipeline's schedules measured: per-rank timelines, the bubble fraction against its theory.

  python -m benchmarks.pipeline [--preset medium] [--pp 2] [--micro-batches 8] [--steps 6]
                                [--plot docs/figures/pipeline.png] [-- FLAGS]
  python -m benchmarks.pipeline worker  (under mpirun: prints every rank's events as JSON)

For each schedule (1f1b, afab) one launch of `--pp` ranks (one per core, no data parallelism)
trains `--steps` steps of `--micro-batches` micro-batches. Each rank records when it computed the
forward and the backward of each micro-batch (capstone.parallel.pipeline); a stage's bubble is the
part of the step's pipeline span (the first forward's start on any stage to the last backward's
end) in which it computed nothing. Theory, for equal stages and free messages: (p-1)/(m+p-1).
Prints the median over the steps after the first, per schedule, and draws the last step's
timeline of both (like the schedule figures of the GPipe and Megatron-LM papers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks import workers


def worker(argv: list[str]) -> int:
    from capstone import cli
    from capstone import run as runs
    from capstone import train
    from capstone.collective import launch
    from capstone.runtime import heap
    heap.keep_freed_memory()   # the heap settings of every training rank (capstone.train.main)
    world = launch.world()
    settings = cli.parse_on_every_rank(argv, world.rank)
    run = runs.open_run(world, settings)
    steps = []
    for s in range(1, settings.train.steps + 1):
        train.train_step(run, s)
        sched = run.schedule
        mine = {"stage": run.grid.pp.rank, "dp": run.grid.dp.rank, "tp": run.grid.tp.rank,
                "events": sched.events, "span": list(sched.span)}
        steps.append(world.allgather_json(mine))
    if world.rank == 0:
        print("RESULT " + json.dumps({"pp": run.grid.pp.size, "micro_batches": settings.train.grad_accum,
                                      "schedule": run.plan.schedule, "steps": steps}), flush=True)
    return 0


def launch(ranks: int, flags: list, timeout: float = 1800) -> dict:
    """One schedule under mpirun; its RESULT (every rank's events)."""
    return workers.launch("benchmarks.pipeline", ranks, flags, timeout)


def bubbles(ranks: list[dict]) -> list[float]:
    """Each rank's idle fraction of the step's pipeline span (first forward anywhere to last backward)."""
    start = min(e[2] for r in ranks for e in r["events"])
    end = max(e[3] for r in ranks for e in r["events"])
    return [1.0 - sum(e[3] - e[2] for e in r["events"]) / (end - start) for r in ranks]


def theory(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 0.9 * len(results) * results["1f1b"]["pp"]))
    for ax, (name, res) in zip(axes, results.items()):
        ranks = res["steps"][-1]
        t0 = min(e[2] for r in ranks for e in r["events"])
        for r in ranks:
            for kind, j, a, b in r["events"]:
                color = "#7fb3d5" if kind == "F" else "#1f4e79"
                ax.barh(r["stage"], (b - a) * 1e3, left=(a - t0) * 1e3, color=color, edgecolor="white", height=0.8)
                ax.text((a + b - 2 * t0) * 500, r["stage"], str(j), ha="center", va="center", fontsize=7,
                        color="black" if kind == "F" else "white")
        bub = statistics.mean(bubbles(ranks))
        ax.set_title(f"{name}: p={res['pp']}, m={res['micro_batches']}; bubble {100 * bub:.1f}% "
                     f"(theory {100 * theory(res['pp'], res['micro_batches']):.1f}%); light: forward, dark: backward",
                     fontsize=9)
        ax.set_yticks(range(res["pp"]), [f"stage {p}" for p in range(res["pp"])])
        ax.invert_yaxis()
        ax.set_xlabel("ms since the step's first forward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="medium")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--plot", default=None, help="write the timeline picture here (PNG)")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    results = {}
    for schedule in ("1f1b", "afab"):
        flags = ["--preset", args.preset, "--pp", args.pp, "--grad-accum", args.micro_batches, "--steps", args.steps,
                 "--pp-schedule", schedule, *extra]
        results[schedule] = launch(args.pp, flags)
    m, pp = args.micro_batches, args.pp
    print(f"{args.preset}, pp {pp}, {m} micro-batches, one rank per stage; bubble: median over steps 2..{args.steps}")
    print(f"{'schedule':<9} {'theory':>7} {'measured':>9}  per stage")
    for name, res in results.items():
        per_step = [bubbles(ranks) for ranks in res["steps"][1:]]
        stages = [statistics.median(s[r] for s in per_step) for r in range(len(per_step[0]))]
        print(f"{name:<9} {100 * theory(pp, m):>6.1f}% {100 * statistics.median(map(statistics.mean, per_step)):>8.1f}%  "
              + " ".join(f"{100 * b:.1f}%" for b in stages))
    if args.plot:
        plot(results, args.plot)
        print(f"timeline of the last step: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
