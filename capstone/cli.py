"""Command line of `python -m capstone.train`: flags -> validated configs and run options."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

from .config import ConfigError, ModelConfig, TrainConfig


@dataclass(frozen=True)
class RunOptions:
    """What a run does besides training: where it writes, resumes from, and test hooks."""

    out: str | None = None
    resume: str | None = None
    stop_after: int = 0
    sleep_per_step: float = 0.0
    inject_lr_spike: tuple[int, float] | None = None
    inject_nan: tuple[int, int] | None = None
    quiet: bool = False


def _spike(text: str) -> tuple[int, float]:
    step, _, mult = text.partition(":")
    try:
        return int(step), float(mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP:MULT like 12:1000, got {text!r}") from None


def _nan(text: str) -> tuple[int, int]:
    step, _, count = text.partition(":")
    try:
        return int(step), int(count or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP or STEP:COUNT like 7 or 7:3, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """Bad syntax raises ConfigError (printed once, by rank 0) instead of printing on every rank."""

    def error(self, message):
        raise ConfigError(f"{message}. Run `python -m capstone.train --help` for every flag and its meaning.")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m capstone.train",
        description="Train the MiniGPT data-parallel with ZeRO-1 and sharded HDF5 checkpoints; run under "
                    "mpirun/srun (any number of ranks). Checks the four invariants and exits non-zero if one fails.")
    m, t = ModelConfig(), TrainConfig()
    g = p.add_argument_group("model")
    g.add_argument("--vocab-size", type=int, default=m.vocab_size, help="vocabulary size V")
    g.add_argument("--seq-len", type=int, default=m.seq_len, help="sequence length T (context)")
    g.add_argument("--d-model", type=int, default=m.d_model, help="model width C")
    g.add_argument("--n-heads", type=int, default=m.n_heads, help="attention heads H (must divide d-model)")
    g.add_argument("--n-layers", type=int, default=m.n_layers, help="transformer blocks L")
    g = p.add_argument_group("training")
    g.add_argument("--seed", type=int, default=t.seed, help="seed of the initial parameters and of the data order")
    g.add_argument("--steps", type=int, default=t.steps, help="optimizer steps of the whole run")
    g.add_argument("--batch-size", type=int, default=t.batch_size, help="sequences per rank per micro-batch")
    g.add_argument("--grad-accum", type=int, default=t.grad_accum, help="micro-batches summed per optimizer step")
    g.add_argument("--lr", type=float, default=t.lr, help="peak learning rate")
    g.add_argument("--lr-schedule", choices=("constant", "cosine"), default=t.lr_schedule, help="decay after warmup")
    g.add_argument("--warmup-steps", type=int, default=t.warmup_steps, help="linear warmup steps")
    g.add_argument("--min-lr", type=float, default=t.min_lr, help="final learning rate of the cosine schedule")
    g.add_argument("--beta1", type=float, default=t.beta1, help="Adam beta1")
    g.add_argument("--beta2", type=float, default=t.beta2, help="Adam beta2")
    g.add_argument("--eps", type=float, default=t.eps, help="Adam epsilon")
    g.add_argument("--weight-decay", type=float, default=t.weight_decay, help="decoupled (AdamW) weight decay of matrices")
    g.add_argument("--clip", type=float, default=t.clip, help="clip the global gradient norm to this (0: off)")
    g.add_argument("--corpus-tokens", type=int, default=t.corpus_tokens, help="length of the synthetic corpus")
    g.add_argument("--corpus-seed", type=int, default=t.corpus_seed, help="seed of the synthetic corpus")
    g.add_argument("--loss-tol", type=float, default=t.loss_tol,
                   help="invariant (a): a step may raise the held-out loss by at most this (float noise) ...")
    g.add_argument("--loss-tol-rel", type=float, default=t.loss_tol_rel,
                   help="... plus this fraction of the decrease achieved so far (the wiggle of a converging run)")
    g = p.add_argument_group("checkpoints and guard")
    g.add_argument("--ckpt-every", type=int, default=t.ckpt_every, help="checkpoint every K steps (0: off)")
    g.add_argument("--ckpt-every-minutes", type=float, default=t.ckpt_every_minutes,
                   help="also checkpoint when this many minutes of wall clock passed since the last one (0: off)")
    g.add_argument("--keep-last", type=int, default=t.keep_last, help="keep only the newest K checkpoints (0: all)")
    g.add_argument("--spike-factor", type=float, default=t.spike_factor,
                   help="roll back when the loss exceeds this factor times the last accepted loss")
    g.add_argument("--max-rollbacks", type=int, default=t.max_rollbacks,
                   help="stop with an error when the guard fires more than this many times without an accepted update")
    g = p.add_argument_group("run")
    g.add_argument("--out", default=None, help="run directory (default: runs/run-<time>); checkpoints go to OUT/checkpoints")
    g.add_argument("--resume", default=None,
                   help="checkpoint to continue from: a ckpt-*.h5 path, 'latest' (newest complete one in OUT), "
                        "or 'auto' (latest if there is one, else start fresh)")
    g.add_argument("--stop-after", type=int, default=0,
                   help="checkpoint and stop (status 'preempted') after this step, as if preempted (0: off)")
    g.add_argument("--sleep-per-step", type=float, default=0.0, help="sleep this many seconds per step (tests of signals)")
    g.add_argument("--inject-lr-spike", type=_spike, default=None, metavar="STEP:MULT",
                   help="fault injection: multiply the learning rate of step STEP by MULT")
    g.add_argument("--inject-nan", type=_nan, default=None, metavar="STEP[:COUNT]",
                   help="fault injection: make the gradient NaN at STEP (and the COUNT-1 steps after)")
    g.add_argument("--quiet", action="store_true", help="print only the final report")
    return p


def parse(argv=None) -> tuple[ModelConfig, TrainConfig, RunOptions]:
    """Parse and validate; raises ConfigError (with what to do) on bad values, SystemExit on bad syntax."""
    args = build_parser().parse_args(argv)
    values = vars(args)
    model = ModelConfig(**{f.name: values[f.name] for f in dataclasses.fields(ModelConfig)})
    train = TrainConfig(**{f.name: values[f.name] for f in dataclasses.fields(TrainConfig)})
    opts = RunOptions(**{f.name: values[f.name] for f in dataclasses.fields(RunOptions)})
    if opts.stop_after < 0 or opts.sleep_per_step < 0:
        raise ConfigError("--stop-after and --sleep-per-step must be >= 0.")
    return model, train, opts


def parse_on_every_rank(argv, rank: int) -> tuple[ModelConfig, TrainConfig, RunOptions]:
    """`parse` on every rank, with --help, usage and errors printed once (by rank 0). A bad
    value exits 2 on every rank; every rank parses the same argv, so they agree without talking."""
    try:
        if rank != 0:
            sys.stdout = open(os.devnull, "w")
        try:
            return parse(argv)
        finally:
            sys.stdout = sys.__stdout__
    except ConfigError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
