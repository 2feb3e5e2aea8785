"""GPT-2 small fine-tuned on CPU ranks: peak RSS per rank against the preflight's estimate, step time, tokens/s;
and transformers' GPT-2 on one process of PyTorch beside it.

  python -m benchmarks.gpt2_finetune [--preset gpt2|gpt2-mini] [--ranks 4] [--steps 3] [--torch PYTHON]
                                     [-- FLAGS]

capstone: `--preset gpt2` (124M parameters, seq 1024; or gpt2-mini: 4 blocks of width 256, seq 256;
random weights, the synthetic corpus) on RANKS ranks with FLAGS (default `--zero-stage 3 --recompute
--pp 2 --grad-accum 2`; tied, as GPT-2: wte on the first and last stages),
STEPS steps (collective timeout 3600 s: a loaded machine's step can outlast the automatic 300 s); the
median step time of the steps after the first, tokens/s of the global batch, and
each rank's peak RSS (VmHWM, the run's memory table) against capstone.runtime.preflight's estimate
for its heaviest rank. PyTorch (`--torch`, a Python with torch and transformers, e.g.
.venv-torch/bin/python): GPT2LMHeadModel of GPT2Config() with one thread, batch 1 x 1024, AdamW
(benchmarks/hf_gpt2_step.py). Per core: capstone's tokens/s over the machine's cores (its ranks
share them), torch's over its one thread. docs/gpt2.md shows a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FLAGS = ["--zero-stage", "3", "--recompute", "--pp", "2", "--grad-accum", "2"]
MIB = 1 << 20


def capstone_run(preset: str, ranks: int, steps: int, flags: list[str]) -> dict:
    """One training run; its step times, global-batch tokens, peak RSS per rank and the preflight's estimate."""
    from capstone import cli
    from capstone.plan import Plan
    from capstone.runtime import preflight
    argv = ["--preset", preset, "--steps", str(steps), "--eval-every", str(steps), "--eval-batches", "1",
            "--eval-batch-size", "2", "--ckpt-every", "0", "--ckpt-every-minutes", "0", "--collective-timeout", "3600",
            "--quiet", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="capstone-gpt2-") as out:
        cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "capstone.train", "--out",
               os.path.join(out, "run"), *argv]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if res.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stdout[-3000:]}"
                             f"{res.stderr[-3000:]}")
        with open(os.path.join(out, "run", "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "step_ms" in r]
        with open(os.path.join(out, "run", "summary.json")) as f:
            summary = json.load(f)
    settings = cli.parse(argv)
    plan = Plan.make(model=settings.model, train=settings.train, world=ranks, given=settings.layout)[0]
    acts, states = preflight.estimate(settings.model, settings.train, plan)
    tokens = rows[-1]["tokens"]
    step_ms = statistics.median(r["step_ms"] for r in rows[1:] or rows)
    return {"step_ms": step_ms, "tokens": tokens, "tokens_per_s": tokens / (step_ms / 1e3),
            "rss_mib": [r["peak_rss_bytes"] / MIB for r in summary["memory"]["per_rank"]],
            "estimate_mib": (acts + states) / MIB, "activations_mib": acts / MIB, "states_mib": states / MIB}


def torch_run(python: str, steps: int, model) -> dict:
    """transformers' GPT-2 of capstone's ModelConfig `model` (its shape) on one process, one thread."""
    shape = [model.n_layers, model.d_model, model.n_heads, model.seq_len]
    script = os.path.join(ROOT, "benchmarks", "hf_gpt2_step.py")
    res = subprocess.run([python, script, str(steps), "1", *map(str, shape)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        raise SystemExit(f"{python} benchmarks/hf_gpt2_step.py failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt2_finetune", description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("gpt2", "gpt2-mini"), default="gpt2", help="the model's shape")
    p.add_argument("--ranks", type=int, default=4, help="MPI ranks of the capstone run")
    p.add_argument("--steps", type=int, default=3, help="training steps (the first is not timed)")
    p.add_argument("--torch", default=None, metavar="PYTHON",
                   help="a Python with torch + transformers (else no torch row)")
    p.add_argument("flags", nargs="*", help=f"capstone flags after -- (default: {' '.join(DEFAULT_FLAGS)})")
    args = p.parse_args(argv)
    flags, cores = args.flags or DEFAULT_FLAGS, os.cpu_count() or 1
    c = capstone_run(args.preset, args.ranks, args.steps, flags)
    print(f"capstone --preset {args.preset} {' '.join(flags)} on {args.ranks} ranks ({cores} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end):")
    print(f"  step {c['step_ms'] / 1e3:.1f} s (median after the first), {c['tokens']} tokens a step, "
          f"{c['tokens_per_s']:.0f} tokens/s, {c['tokens_per_s'] / min(cores, args.ranks):.0f} tokens/s per core")
    print(f"  peak RSS per rank (MiB): {', '.join(f'{r:.0f}' for r in c['rss_mib'])}; preflight estimate of the "
          f"heaviest rank {c['estimate_mib']:.0f} MiB ({c['activations_mib']:.0f} activations or checkpoint conversion + "
          f"{c['states_mib']:.0f} model states)")
    if args.torch:
        from capstone import cli
        t = torch_run(args.torch, args.steps, cli.parse(["--preset", args.preset]).model)
        print(f"transformers GPT2LMHeadModel ({t['parameters'] / 1e6:.1f}M parameters, tied) on 1 process, 1 thread: "
              f"step {t['step_s']:.1f} s, {t['tokens_per_s']:.0f} tokens/s per core, peak RSS {t['peak_rss_mib']:.0f} "
              f"MiB (torch {t['torch']}, transformers {t['transformers']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
