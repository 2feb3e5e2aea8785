"""The cost of --deterministic: `mpirun -n 4 python -m benchmarks.determinism [--repeats 3] [--tp 1,2] [--reduction-only]`.

First the phase the mode replaces, alone (no forward/backward, so less noise): the gradient
reduction and norm, default (one reduce-scatter) vs deterministic (an Alltoall and the fixed
trees), at the reference and medium sizes. Then the step time of whole training runs in both
modes, interleaved so drift in the machine's load hits both (docs/deterministic.md quotes it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from capstone import cli, train
from capstone.config import ModelConfig
from capstone.model.gpt import Model
from capstone.model.params import Layout, init_params
from capstone.collective import launch
from capstone.parallel.buckets import BucketReducer
from capstone.parallel.chunksums import ChunkSums
from capstone.parallel.deterministic import DeterministicReducer
from capstone.parallel.grid import Grid
from capstone.parallel.reduce import Flags
from capstone.flags.presets import PRESETS
from capstone.run import open_run
from capstone.runtime import heap


def reduction(world, repeats: int) -> None:
    """Collective. The gradient reduction and norm alone, default vs deterministic, grad_accum 1."""
    medium = {k: v for k, v in PRESETS["medium"].items() if k in ModelConfig.__dataclass_fields__}
    grid = Grid.build(world)
    if world.rank == 0:
        print(f"gradient reduction + norm alone on {world.size} ranks, grad_accum 1 (best of {repeats}, ms):")
    for name, cfg in (("reference", ModelConfig()), ("medium", ModelConfig(**medium))):
        layout = Layout.for_model(cfg, world.size)
        model = Model.over(cfg, layout, init_params(layout, cfg, 0))
        model.grads[:layout.n_params] = np.random.default_rng(world.rank).standard_normal(layout.n_params) * 1e-3
        default = BucketReducer(grid, layout, model.grads, layout.padded)
        idx = np.full(layout.padded, -1, dtype=np.int64)
        idx[:layout.n_params] = np.arange(layout.n_params)
        det = DeterministicReducer(grid, layout, model.grads, 1,
                                   ChunkSums(world, idx[slice(*layout.shard_range(world.rank))], layout.n_params))

        def deterministic():
            det.after_backward(0)
            det.finish([0.5], Flags())

        best = {}
        for label, fn in (("default", lambda: default.finish([0.5], Flags())), ("deterministic", deterministic)):
            times = []
            for _ in range(repeats):
                world.Barrier()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best[label] = 1e3 * min(times)
        if world.rank == 0:
            print(f"  {name:<10} {layout.n_params:>9} params: default {best['default']:8.2f}, "
                  f"deterministic {best['deterministic']:8.2f}")


def runs(world, args) -> None:
    """Collective. Step time of default vs --deterministic training runs, reference and medium."""
    tmp = world.bcast_json(tempfile.mkdtemp(prefix="capstone-det-bench-") if world.rank == 0 else None)
    medium = ["--preset", "medium", "--steps", str(args.medium_steps), "--eval-every", "1000", "--warmup-steps", "0"]
    sizes = [("reference", ["--steps", str(args.reference_steps)])]
    sizes += [(f"medium tp{tp}", medium + ["--tp", str(tp)]) for tp in args.tp]
    common = ["--quiet", "--ckpt-every", "0", "--ckpt-every-minutes", "0"]
    modes = ("default", "deterministic")
    rows = {(name, mode): [] for name, _ in sizes for mode in modes}
    for name, flags in sizes:
        for rep in range(args.repeats):      # the modes interleaved, so drift in the machine's load hits both
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                out = os.path.join(tmp, f"{name}-{mode}-{rep}")
                argv = flags + common + ["--out", out] + (["--deterministic"] if mode == "deterministic" else [])
                run = open_run(world, cli.parse(argv))
                with contextlib.redirect_stdout(io.StringIO()):
                    train.train(run)
                if world.rank == 0:
                    with open(os.path.join(out, "metrics.jsonl")) as f:
                        rows[(name, mode)] += [r for r in map(json.loads, f) if r.get("step", 0) >= 2]
    if world.rank == 0:
        print(f"step time on {world.size} ranks, default vs --deterministic (rank 0, median ms over steps 2.. of "
              f"{args.repeats} runs each; reference {args.reference_steps} steps, medium {args.medium_steps} steps):")
        print(f"  {'size':<12} {'mode':<14} {'step':>9} {'fwd_bwd':>9} {'reduce':>9} {'ratio':>6}")
        for name, _ in sizes:
            base = statistics.median(r["step_ms"] for r in rows[(name, "default")])
            for mode in modes:
                med = {k: statistics.median(r[k] for r in rows[(name, mode)]) for k in ("step_ms", "fwd_bwd_ms", "reduce_ms")}
                print(f"  {name:<12} {mode:<14} {med['step_ms']:>9.2f} {med['fwd_bwd_ms']:>9.2f} "
                      f"{med['reduce_ms']:>9.2f} {med['step_ms'] / base:>6.2f}")
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.determinism", description=__doc__.splitlines()[0])
    p.add_argument("--reference-steps", type=int, default=10)
    p.add_argument("--medium-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tp", type=lambda v: [int(t) for t in v.split(",")], default=[1],
                   help="the medium runs' tensor-parallel degrees, e.g. 1,2 (default: 1)")
    p.add_argument("--reduction-only", action="store_true", help="only the reduction phase, without training runs")
    args = p.parse_args(argv)
    world = launch.world()
    heap.keep_freed_memory()
    reduction(world, 20)
    if not args.reduction_only:
        runs(world, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
