"""Benchmarks that print figures (not timed tests).

  python -m benchmarks.bench speed [--vs-torch PYTHON]     single-thread training step at three sizes,
                                                         BLAS share at medium; optionally against
                                                         PyTorch eager (benchmarks/torch_model.py)
  python -m benchmarks.bench memory                        peak and per-step RSS at medium vs the budget
  python -m benchmarks.bench checks                        cost of train.py's per-step checks at medium
  python -m benchmarks.bench steps RUN_DIR [RUN_DIR ...]   per-step time split from metrics.jsonl
  python -m benchmarks.bench model                         serial forward+backward time, two sizes
  mpirun -n 4 python -m benchmarks.bench comm [--sizes ...] reduce-scatter variants vs allreduce
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.step import SIZES, checks, memory, speed

SPLIT = ("fwd_bwd_ms", "reduce_ms", "optimizer_ms", "eval_ms", "checks_ms", "step_ms")   # the step's phases


def step_split(run_dirs: list[str], eval_every: int = 0) -> None:
    """Median and mean of each phase over steps 2.. of every run (step 1 pays one-off warm-up)."""
    rows, walls, sizes = [], [], set()
    for d in run_dirs:
        with open(os.path.join(d, "metrics.jsonl")) as f:  # after a resume a step may repeat: last wins
            by_step = {r["step"]: r for r in map(json.loads, f) if "step" in r}
        rows += [r for step, r in sorted(by_step.items()) if step >= 2 and r["accepted"]]
        with open(os.path.join(d, "summary.json")) as f:
            summary = json.load(f)
        walls.append(summary["wall_seconds"])
        sizes.add((summary["padded"], summary["world_size"]))
    print(f"per-step time over {len(rows)} steps of {len(run_dirs)} runs (rank 0, ms):")
    print(f"  {'phase':<18} {'median':>8} {'mean':>8}")
    for key in SPLIT:
        vals = [r[key] for r in rows]
        print(f"  {key[:-3]:<18} {statistics.median(vals):>8.3f} {statistics.mean(vals):>8.3f}")
    print(f"training loop wall time ({len(rows) // len(run_dirs) + 1} steps, checkpoints, checks): "
          f"median {statistics.median(walls):.3f} s")
    print(overhead(rows, eval_every or summary["train_config"]["eval_every"]))
    if len(sizes) == 1 and any("comm" in r for r in rows):  # runs of one model on one world size
        from capstone.observe.accounting import comm_summary, format_comm_summary
        print("collectives per step over the same steps (rank 0's clock, median of the time waited for each; "
              "nccl-tests bytes S, algbw, busbw):")
        print("  " + format_comm_summary(comm_summary(rows, skip_first=False)).replace("\n", "\n  "))


def overhead(rows: list[dict], eval_every: int) -> str:
    """The whole step (checks, evaluation, logging) over its core: forward+backward, the gradient
    reduction and the update (Adam and its allgather), summed over the rows; and, from the
    non-evaluation steps and the cost of one evaluation, the ratio of a run that evaluates every
    `eval_every` steps."""
    core = lambda r: r["fwd_bwd_ms"] + r["reduce_ms"] + r["optimizer_ms"]  # noqa: E731
    extra = lambda rs: statistics.mean(r["step_ms"] - core(r) for r in rs)  # noqa: E731
    plain, evals = [r for r in rows if r["eval_loss"] is None], [r for r in rows if r["eval_loss"] is not None]
    line = (f"whole step / (fwd_bwd + reduce + optimizer): {sum(r['step_ms'] for r in rows) / sum(map(core, rows)):.3f} "
            f"over these {len(rows)} steps ({len(evals)} evaluating)")
    if plain and evals:
        per_eval = extra(evals) - extra(plain)
        base = statistics.mean(map(core, plain))
        line += (f"; {1 + extra(plain) / base:.3f} without evaluation; one evaluation adds {per_eval:.1f} ms, so "
                 f"a run evaluating every {eval_every} steps: {1 + (extra(plain) + per_eval / eval_every) / base:.3f}")
    return line


def model(repeats: int) -> None:
    """Serial forward+backward time of one micro-batch at two sizes (float32, one thread)."""
    from capstone.config import ModelConfig
    from capstone.data.synthetic import DataStream, make_corpus
    from capstone.model.gpt import loss_and_grad
    from capstone.model.params import Layout, init_params
    print(f"forward+backward of one micro-batch, serial, best of {repeats} (ms):")
    for cfg, B in ((ModelConfig(), 4), (ModelConfig(vocab_size=256, seq_len=128, d_model=256, n_heads=4, n_layers=4), 8)):
        layout = Layout.for_model(cfg, 1)
        flat = init_params(layout, cfg, 0)
        x, y = DataStream(make_corpus(0, 1 << 16, cfg.vocab_size), cfg.seq_len, B, 0).samples(0, B)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            loss_and_grad(layout, flat, x, y, cfg, 1.0 / x.size)
            times.append(time.perf_counter() - t)
        print(f"  d_model {cfg.d_model:>4}, {cfg.n_layers} layers, T {cfg.seq_len:>3}, B {B}, "
              f"{layout.n_params:>8} params: {1e3 * min(times):8.2f}")


def comm(sizes: list[int], repeats: int) -> None:
    """Collective: call on all ranks. Time the ways to get a summed gradient shard."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    if rank == 0:
        print(f"gradient reduction on {n} ranks, float32, best of {repeats} (ms):")
        print(f"  {'floats':>10} {'Reduce_scatter_block':>21} {'Reduce_scatter':>15} {'Allreduce':>10} {'Allgather':>10}")
    for size in sizes:
        size = -(-size // n) * n
        send = np.full(size, rank + 1, dtype=np.float32)
        shard = np.empty(size // n, dtype=np.float32)
        full = np.empty(size, dtype=np.float32)

        def best(fn):
            times = []
            for _ in range(repeats):
                world.Barrier()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return 1e3 * min(times)
        t_rsb = best(lambda: world.Reduce_scatter_block(send, shard, op=MPI.SUM))
        t_rs = best(lambda: world.Reduce_scatter(send, shard, [size // n] * n, op=MPI.SUM))
        t_ar = best(lambda: world.Allreduce(send, full, op=MPI.SUM))
        t_ag = best(lambda: world.Allgather(MPI.IN_PLACE, full))
        if rank == 0:
            print(f"  {size:>10} {t_rsb:>21.3f} {t_rs:>15.3f} {t_ar:>10.3f} {t_ag:>10.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("steps", help="per-step time split of finished runs")
    s.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl and summary.json)")
    s.add_argument("--eval-every", type=int, default=0,
                   help="the evaluation interval of the whole-step ratio (default: the runs' own)")
    c = sub.add_parser("comm", help="collective timings (run under mpirun)")
    c.add_argument("--sizes", type=int, nargs="+", default=[30_144, 1_000_000, 4_000_000], help="floats per rank")
    c.add_argument("--repeats", type=int, default=10, help="repetitions; the best is reported")
    m = sub.add_parser("model", help="serial forward+backward time at two model sizes")
    m.add_argument("--repeats", type=int, default=5, help="repetitions; the best is reported")
    sp = sub.add_parser("speed", help="single-thread training step at three sizes (and vs PyTorch eager)")
    sp.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    sp.add_argument("--repeats", type=int, default=0, help="steps per size (default: 200, 20, 5 by size)")
    sp.add_argument("--vs-torch", metavar="PYTHON", help="a Python with torch (a separate venv) to run benchmarks/torch_model.py")
    sp.add_argument("--blas-steps", type=int, default=10, help="steps timed with the matmul wrapper at medium (0: skip)")
    me = sub.add_parser("memory", help="RSS of one rank at medium against the computed budget")
    me.add_argument("--steps", type=int, default=200)
    ch = sub.add_parser("checks", help="cost of train.py's fingerprint and held-out eval at medium")
    ch.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    from capstone.runtime.heap import keep_freed_memory  # the heap settings every training rank runs with
    keep_freed_memory()
    if args.cmd == "speed":
        reps = {"reference": 200, "medium": 20, "large": 5}
        return speed(args.sizes, {k: args.repeats or v for k, v in reps.items()}, args.vs_torch, args.blas_steps)
    if args.cmd == "memory":
        memory(args.steps)
    elif args.cmd == "checks":
        checks(args.repeats)
    elif args.cmd == "steps":
        step_split(args.runs, args.eval_every)
    elif args.cmd == "model":
        model(args.repeats)
    else:
        comm(args.sizes, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
