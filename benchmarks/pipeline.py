"""The pipeline's schedules measured: per-rank timelines, the bubble fraction against its theory, the
activations a stage holds.

  python -m benchmarks.pipeline [--preset medium] [--pp 2] [--micro-batches 8,16] [--steps 6]
                                [--plot docs/figures/pipeline.png] [--no-memory] [-- FLAGS]
  python -m benchmarks.pipeline worker  (under mpirun: prints every rank's events as JSON)

For each schedule (1f1b, afab, zb-h1) and number of micro-batches, one launch of `--pp` ranks (one
per core, no data parallelism) trains `--steps` steps. Each rank records when it computed the
forward (F), the backward (B; zb-h1: the input's gradient) and zb-h1's weight gradients (W) of each
micro-batch (capstone.parallel.pipeline); a stage's bubble is the part of the step's pipeline span
(the first forward's start on any stage to the last backward's end) in which it computed nothing.
Theory, for equal stages and free messages: (p-1)/(m+p-1) for 1f1b and afab; for zb-h1
(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W)) with the measured mean F, B and W (Qi et al.). Prints the
median over the steps after the first, and (`benchmarks.memory --trace`, 3 steps) each stage's peak
of allocated bytes above the step's start during the forwards and backwards: the activations it
holds. Draws the last step's timeline of each schedule at the first micro-batch count (like the
schedule figures of the GPipe, Megatron-LM and zero-bubble papers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks import memory, workers

SCHEDULES = ("1f1b", "afab", "zb-h1")


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
    steps, ms = [], []
    for s in range(1, settings.train.steps + 1):
        ms.append(train.train_step(run, s).ms["step"])
        sched = run.schedule
        mine = {"stage": run.grid.pp.rank, "dp": run.grid.dp.rank, "tp": run.grid.tp.rank,
                "events": sched.events, "span": list(sched.span)}
        steps.append(world.allgather_json(mine))
    if world.rank == 0:
        print("RESULT " + json.dumps({"pp": run.grid.pp.size, "micro_batches": settings.train.grad_accum,
                                      "schedule": run.plan.schedule, "steps": steps, "step_ms": ms,
                                      "post_validation": getattr(run.opt, "counts", None)}), flush=True)
    return 0


def launch(ranks: int, flags: list, timeout: float = 1800) -> dict:
    """One schedule under mpirun; its RESULT (every rank's events)."""
    return workers.launch("benchmarks.pipeline", ranks, flags, timeout)


def bubbles(ranks: list[dict]) -> list[float]:
    """Each rank's idle fraction of the step's pipeline span (first forward anywhere to last backward)."""
    start = min(e[2] for r in ranks for e in r["events"])
    end = max(e[3] for r in ranks for e in r["events"])
    return [1.0 - sum(e[3] - e[2] for e in r["events"]) / (end - start) for r in ranks]


def theory(p: int, m: int, res: dict | None = None) -> float:
    """The bubble of equal stages with free messages (zb-h1: at the measured mean F, B, W of `res`)."""
    if res is None or res["schedule"] != "zb-h1":
        return (p - 1) / (m + p - 1)
    t = {k: statistics.mean(e[3] - e[2] for ranks in res["steps"][1:] for r in ranks for e in r["events"] if e[0] == k)
         for k in "FBW"}
    idle = (p - 1) * (t["F"] + t["B"] - t["W"])
    return idle / (m * (t["F"] + t["B"] + t["W"]) + idle)


def simulate(orders: dict, t: dict) -> float:
    """The mean bubble of stages 0..K-1 running `orders` (stage -> [(kind, j)]) with durations t[kind] and free
    messages: a forward waits for the previous stage's of its micro-batch, a backward for the next stage's."""
    K = len(orders)
    done, clock, busy, at = {}, [0.0] * K, [0.0] * K, [0] * K
    while any(at[p] < len(orders[p]) for p in range(K)):
        moved = False
        for p in range(K):
            while at[p] < len(orders[p]):
                kind, j = orders[p][at[p]]
                dep = ("F", p - 1, j) if kind == "F" and p > 0 else ("B", p + 1, j) if kind == "B" and p < K - 1 else None
                if dep is not None and dep not in done:
                    break
                clock[p] = max(clock[p], done.get(dep, 0.0)) + t[kind]
                busy[p], done[(kind, p, j)], at[p], moved = busy[p] + t[kind], clock[p], at[p] + 1, True
        if not moved:
            raise ValueError("the stages' orders wait on each other")
    return 1 - sum(busy) / (K * max(clock))


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 0.9 * len(results) * next(iter(results.values()))["pp"]))
    axes = axes if len(results) > 1 else [axes]
    for ax, (name, res) in zip(axes, results.items()):
        ranks = res["steps"][-1]
        t0 = min(e[2] for r in ranks for e in r["events"])
        for r in ranks:
            for kind, j, a, b in r["events"]:
                color = {"F": "#7fb3d5", "B": "#1f4e79", "W": "#c0504d"}[kind]
                ax.barh(r["stage"], (b - a) * 1e3, left=(a - t0) * 1e3, color=color, edgecolor="white", height=0.8)
                ax.text((a + b - 2 * t0) * 500, r["stage"], str(j), ha="center", va="center", fontsize=7,
                        color="black" if kind == "F" else "white")
        bub = statistics.mean(bubbles(ranks))
        ax.set_title(f"{name}: p={res['pp']}, m={res['micro_batches']}; bubble {100 * bub:.1f}% "
                     f"(theory {100 * theory(res['pp'], res['micro_batches'], res):.1f}%); light: forward, dark: "
                     f"backward" + (" (the input's gradient), red: the weights' gradients" if name == "zb-h1" else ""),
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
    p.add_argument("--micro-batches", default="8,16", help="comma-separated counts of micro-batches")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--plot", default=None, help="write the timeline picture here (PNG)")
    p.add_argument("--no-memory", action="store_true", help="skip the activations' measurement")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    counts, schedules, pp = [int(m) for m in args.micro_batches.split(",")], args.schedules.split(","), args.pp
    print(f"{args.preset}, pp {pp}, one rank per stage; bubble: median over steps 2..{args.steps}; activations: "
          f"peak MiB above the step's start")
    print(f"{'schedule':<9} {'m':>3} {'theory':>7} {'measured':>9}  {'per stage':<14} {'step ms':>8}  "
          f"activations per stage")
    plotted, redone = {}, []
    for m in counts:
        for schedule in schedules:
            flags = ["--preset", args.preset, "--pp", pp, "--grad-accum", m, "--pp-schedule", schedule, *extra]
            res = launch(pp, [*flags, "--steps", args.steps])
            per_step = [bubbles(ranks) for ranks in res["steps"][1:]]
            stages = [statistics.median(s[r] for s in per_step) for r in range(len(per_step[0]))]
            held = "" if args.no_memory else " ".join(
                f"{r['activations'] / (1 << 20):.1f}" for r in memory.launch(pp, [*flags, "--steps", 3], trace=True)[
                    "per_rank"])
            print(f"{schedule:<9} {m:>3} {100 * theory(pp, m, res):>6.1f}% "
                  f"{100 * statistics.median(map(statistics.mean, per_step)):>8.1f}%  "
                  + f"{' '.join(f'{100 * b:.1f}%' for b in stages):<14} {statistics.median(res['step_ms'][1:]):>8.0f}  "
                  + held, flush=True)
            if res["post_validation"]:
                redone.append(f"{schedule} m {m}: {res['post_validation']}")
            if m == counts[0]:
                plotted[schedule] = res
    for line in redone:
        print(f"post-validation, the updates taken ahead over {args.steps} steps (kept, redone by the clip, dropped "
              f"with their batch): {line}")
    if args.plot:
        plot(plotted, args.plot)
        print(f"timeline of the last step at m {counts[0]}: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
