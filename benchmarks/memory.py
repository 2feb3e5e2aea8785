"""Memory of ZeRO stages 1/2/3 with and without --recompute, measured against the formulas.

  python -m benchmarks.memory table   [--preset large] [--ranks 4] [--steps 4] [--repeats 1] [-- FLAGS]
  python -m benchmarks.memory policies --preset medium [--ranks 4] [-- FLAGS]   (default FLAGS: --pp 2 --grad-accum 4)
  python -m benchmarks.memory largest [--ranks 4] [--limit-mib 1024] [-- FLAGS]
  python -m benchmarks.memory precision --preset medium|large [--ranks 4] [--repeats 2] [-- FLAGS]
  python -m benchmarks.memory worker  (under mpirun: one setting, prints JSON)

`table`: per setting, model-state bytes per rank as the run holds them (capstone.observe.memory)
and as the stage's formula says, the peak of bytes allocated during one step (tracemalloc, which
NumPy reports to; the model states allocated before it counted too), the activation part of it,
the peak RSS per rank (VmHWM), and the median step time relative to stage 1 (a separate launch
without tracemalloc, settings interleaved). `largest`: per setting, the most layers at d_model 512
(the `large` batch and sequence length) whose peak RSS per rank stays within the limit, found by
launching real runs (the guard's undo state and everything else a run holds included). `policies`:
the table for ZeRO-1, 2 and 3 under a pipeline with each --reshard policy (per micro-batch: a
gather and a reduce-scatter for each micro-batch; per step: one of each per step, the stage's
gathered parameters and whole gradient kept through it). `precision`: each ZeRO stage in fp32 and in
--precision bf16: the model states per kind as held (and whether they are the stage's formula), the
activations the forward passes keep, the bytes each rank sends per step (the collectives table's ring
figures), and the step time, the two precisions' timed launches alternated.
docs/performance.md shows the output and says which stage to choose.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks import workers

SETTINGS = [(1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]   # (stage, recompute)
POLICIES = [("stage 1", ["--zero-stage", "1"])] + [
    (f"stage {s}, per {p}", ["--zero-stage", str(s), "--reshard", p]) for s in (2, 3) for p in ("micro-batch", "step")]
MIB = 1 << 20


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def worker(argv: list[str]) -> int:
    """One setting on the ranks of this mpirun: `--trace` measures allocations, else step times."""
    import tracemalloc
    trace = "--trace" in argv
    flags = [a for a in argv if a != "--trace"]
    if trace:
        tracemalloc.start()
    from capstone import cli
    from capstone import run as runs
    from capstone import train
    from capstone.observe import memory
    from capstone.collective import launch
    from capstone.runtime import heap
    heap.keep_freed_memory()   # the heap settings of every training rank (capstone.train.main)
    world = launch.world()
    settings = cli.parse_on_every_rank(flags, world.rank)
    run = runs.open_run(world, settings)
    steps, times, peak, activations = settings.train.steps, [], 0, 0
    finish = run.reducer.finish

    def after_backward(*args):   # the peak of the forward and backward passes, above what the step began with
        nonlocal activations
        activations = max(activations, tracemalloc.get_traced_memory()[1] - start) if trace else 0
        return finish(*args)
    run.reducer.finish = after_backward
    kept, forward = 0, run.model.forward

    def kept_after(*args, **kwargs):   # what a forward pass keeps for its backward: held once it returns
        nonlocal kept
        out = forward(*args, **kwargs)
        kept = max(kept, tracemalloc.get_traced_memory()[0] - start) if trace else 0
        return out
    run.model.forward = kept_after
    from capstone.observe.accounting import step_comm
    for s in range(1, steps + 1):
        if trace:
            tracemalloc.reset_peak()
            start = tracemalloc.get_traced_memory()[0]
        r = train.train_step(run, s)
        times.append(r.ms["step"])
        wire = sum(e["sent_bytes_per_rank"] for e in step_comm(r.traffic).values())
        if trace:
            peak = max(peak, tracemalloc.get_traced_memory()[1])
    held, want = memory.measured(run), memory.formula(run)
    mine = {"states": held.total, "formula": want.total, "rows": held.row(), "formula_rows": want.row(),
            "traced_peak": peak, "activations": activations, "rss_peak": _status_kib("VmHWM") * 1024, "step_ms": statistics.median(times[1:] or times),
            "n_params": run.n_params, "kept": kept, "wire": wire}
    every = world.allgather_json(mine)
    if world.rank == 0:
        print("RESULT " + json.dumps({k: max(e[k] for e in every) for k in ("states", "formula", "traced_peak",
                                                                            "activations", "rss_peak", "step_ms",
                                                                            "kept", "wire")}
                                     | {"rows": every[0]["rows"], "formula_rows": every[0]["formula_rows"],
                                        "n_params": every[0]["n_params"],
                                        "per_rank": [{k: e[k] for k in ("states", "traced_peak", "activations",
                                                                        "rss_peak")} for e in every]}), flush=True)
    return 0


def launch(ranks: int, flags: list, trace: bool = False, timeout: float = 3600) -> dict:
    """One setting under mpirun; its RESULT (max over ranks)."""
    return workers.launch("benchmarks.memory", ranks, [*flags, *(["--trace"] if trace else [])], timeout)


def setting_flags(stage: int, recompute: bool) -> list[str]:
    return ["--zero-stage", str(stage)] + (["--recompute"] if recompute else [])


def name(stage: int, recompute: bool) -> str:
    return f"stage {stage}" + (" + recompute" if recompute else "")


def table(args, settings=None, kept: bool = False) -> None:
    """Per setting (name, flags): the traced launch and the timed launches, interleaved."""
    settings = settings or [(name(*st), setting_flags(*st)) for st in SETTINGS]
    base = ["--preset", args.preset, "--steps", args.steps, *args.extra]
    traced = {n: launch(args.ranks, [*base, "--steps", 3, *flags], trace=True) for n, flags in settings}
    times: dict = {n: [] for n, _ in settings}
    for rep in range(args.repeats):
        for n, flags in settings if rep % 2 == 0 else settings[::-1]:
            times[n].append(launch(args.ranks, [*base, *flags]))
    first = settings[0][0]
    one = statistics.median(t["step_ms"] for t in times[first])
    print(f"{args.preset} on {args.ranks} ranks ({' '.join(map(str, args.extra)) or 'preset flags'}), "
          f"{traced[first]['n_params']} parameters; MiB per rank (max over ranks)")
    print(f"{'setting':<24} {'kept' if kept else '':>6} {'states':>8} {'formula':>8} {'dev':>6} {'traced peak':>12} "
          f"{'activations':>12} {'peak RSS':>9} {'step ms':>8} {'vs ' + first:>10}")
    for n, _ in settings:
        t, ms = traced[n], statistics.median(x["step_ms"] for x in times[n])
        rss, r = max(x["rss_peak"] for x in times[n]), t["rows"]
        across = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["guard_bytes"]
        print(f"{n:<24} {f'{across / MIB:6.1f}' if kept else '':>6} {t['states'] / MIB:>8.1f} {t['formula'] / MIB:>8.1f} "
              f"{100 * (t['states'] - t['formula']) / t['formula']:>5.2f}% {t['traced_peak'] / MIB:>12.1f} "
              f"{t['activations'] / MIB:>12.1f} {rss / MIB:>9.1f} {ms:>8.1f} {ms / one:>10.3f}")
    print("states: params + gathered + grads + reduce + optimizer + guard as held (capstone.observe.memory); "
          "activations: the traced peak of the forward and backward passes above what the step began with"
          + ("; kept: what is held across the step (states without the gathered groups and the reduction's "
             "buffers, transient)" if kept else ""))


def policies(args) -> None:
    """ZeRO-1, 2, 3 under a pipeline, each --reshard policy (default flags: --pp 2 --grad-accum 4)."""
    args.extra = args.extra or ["--pp", "2", "--grad-accum", "4"]
    table(args, POLICIES, kept=True)


def precision(args) -> None:
    """fp32 against --precision bf16 at each ZeRO stage (see the module)."""
    base, keys = ["--preset", args.preset, "--steps", args.steps, *args.extra], [(s, p) for s in range(4)
                                                                                 for p in ("fp32", "bf16")]
    flags = {k: ["--zero-stage", str(k[0]), "--precision", k[1]] for k in keys}
    traced = {k: launch(args.ranks, [*base, "--steps", 3, *flags[k]], trace=True) for k in keys}
    times: dict = {k: [] for k in keys}
    for rep in range(args.repeats):
        for k in keys if rep % 2 == 0 else keys[::-1]:
            times[k].append(launch(args.ranks, [*base, *flags[k]])["step_ms"])
    print(f"{args.preset} on {args.ranks} ranks ({' '.join(map(str, args.extra)) or 'preset flags'}), "
          f"{traced[keys[0]]['n_params']} parameters; MiB per rank (max over ranks), MB sent per rank and step")
    print(f"{'stage':<6}{'':<5} {'params':>7} {'grads':>7} {'optim':>7} {'reduce':>7} {'= formula':>9} "
          f"{'kept act':>9} {'x fp32':>7} {'wire MB':>8} {'x fp32':>7} {'step ms':>8} {'x fp32':>7}")
    for stage, prec in keys:
        t, f, ms = traced[stage, prec], traced[stage, "fp32"], statistics.median(times[stage, prec])
        r = t["rows"]
        print(f"{stage:<6}{prec:<5} {r['params_bytes'] / MIB:>7.2f} {r['grads_bytes'] / MIB:>7.2f} "
              f"{r['optimizer_bytes'] / MIB:>7.2f} {r['reduce_bytes'] / MIB:>7.2f} {str(t['rows'] == t['formula_rows']):>9} "
              f"{t['kept'] / MIB:>9.1f} {t['kept'] / f['kept']:>7.2f} {t['wire'] / 1e6:>8.2f} {t['wire'] / f['wire']:>7.2f} "
              f"{ms:>8.0f} {ms / statistics.median(times[stage, 'fp32']):>7.3f}")
    print("kept act: bytes allocated and still held when a micro-batch's forward pass returns (tracemalloc); "
          "wire: the step's collectives as the collectives table counts them (ring figures, per rank)")


def largest(args) -> None:
    """Per setting, the most layers at d512 within the limit (doubling, then bisection)."""
    base = ["--preset", "large", "--steps", 2, *args.extra]
    limit = args.limit_mib * MIB
    print(f"largest model at d_model 512, seq 256, batch 8 per rank on {args.ranks} ranks with peak RSS <= "
          f"{args.limit_mib} MiB per rank")
    found = {}
    for st in SETTINGS:
        fits, too_big, seen = 0, None, {}

        def probe(layers):
            seen[layers] = launch(args.ranks, [*base, "--n-layers", layers, *setting_flags(*st)])
            return seen[layers]["rss_peak"] <= limit
        layers = 1
        while too_big is None:
            if probe(layers):
                fits, layers = layers, layers * 2
            else:
                too_big = layers
        while too_big - fits > 1:
            mid = (fits + too_big) // 2
            fits, too_big = (mid, too_big) if probe(mid) else (fits, mid)
        found[st] = (fits, seen.get(fits))
        r = seen.get(fits)
        print(f"  {name(*st):<22} {fits:>3} layers  {r['n_params'] / 1e6 if r else 0:>7.1f} M parameters  "
              f"peak RSS {r['rss_peak'] / MIB if r else 0:>7.1f} MiB  ({too_big} layers: "
              f"{seen[too_big]['rss_peak'] / MIB:.1f} MiB)", flush=True)
    a, b = found[(1, False)][1], found[(3, True)][1]
    if a and b:
        print(f"stage 3 + recompute trains {b['n_params'] / a['n_params']:.2f}x the parameters of stage 1 "
              f"in the same {args.limit_mib} MiB per rank")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", choices=("table", "policies", "largest", "precision"))
    p.add_argument("--preset", default="large", help="table, policies: the model and batch")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="table: timed steps per launch (the first is not timed)")
    p.add_argument("--repeats", type=int, default=1, help="table: timed launches per setting, interleaved")
    p.add_argument("--limit-mib", type=int, default=1024, help="largest: peak RSS per rank")
    args, extra = p.parse_known_args(argv)   # the rest: more training flags (after --)
    args.extra = [a for a in extra if a != "--"]
    {"table": table, "policies": policies, "largest": largest, "precision": precision}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
