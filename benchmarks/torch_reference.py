"""The validation-loss reference: a run trained in PyTorch eager on exactly what capstone trains on.

`python -m benchmarks.torch_reference --torch PYTHON [training flags]` takes the same flags as
`capstone.train` (preset, --data, --steps, ...) and drives the PyTorch twin of the model
(benchmarks/torch_model.py, in a venv that has torch): capstone's initial parameters, the same global
batches in the same order (the data stream of one rank), capstone's learning-rate schedule, AdamW
with the same betas, eps, weight decay groups and clip, and the same held-out batches at the same
steps. It prints one line per evaluation; `scripts/bench-shakespeare` quotes the last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from benchmarks.torch_worker import TorchWorker
from capstone import cli
from capstone.config import ConfigError
from capstone.data import open_data
from capstone.data.heldout import HeldOut
from capstone.config import learning_rate
from capstone.model.params import Layout, init_params


def settings_for(argv: list[str]) -> cli.Settings:
    """capstone.train's settings for these flags, with the data's vocabulary (as open_run takes it)."""
    s = cli.parse(argv)
    if s.train.data and "vocab_size" not in s.explicit:
        from capstone.data.tokens import load_meta
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, vocab_size=load_meta(s.train.data).vocab_size))
    return s


def reference(python: str, s: cli.Settings) -> float:
    """Train to s.train.steps in torch; print the validation loss at capstone's evaluation steps; return the last."""
    mcfg, tcfg = s.model, s.train
    G = tcfg.global_batch or tcfg.batch_size * tcfg.grad_accum
    data, _ = open_data(mcfg, tcfg, G)
    heldout = HeldOut(data, tcfg.eval_batches, tcfg.eval_batch_size, mcfg.seq_len, None, 0, 1, None)
    layout = Layout.for_model(mcfg, 1)
    opt = {"lr": tcfg.lr, "betas": (tcfg.beta1, tcfg.beta2), "eps": tcfg.eps, "weight_decay": tcfg.weight_decay,
           "clip": tcfg.clip}
    tw = TorchWorker(python, mcfg, layout, init_params(layout, mcfg, tcfg.seed), data.samples(0, G), opt)
    tw.write("val_x.i64", [x for b in heldout.batches for x in b[0]])
    tw.write("val_y.i64", [y for b in heldout.batches for y in b[1]])
    print(f"torch {tw.info['torch']} eager, {tw.info['threads']} thread: {tcfg.steps} steps of {G} sequences "
          f"x {mcfg.seq_len} tokens, evaluation every {tcfg.eval_every} steps on "
          f"{tcfg.eval_batches} x {tcfg.eval_batch_size} held-out sequences", flush=True)
    t0, val = time.perf_counter(), float("nan")
    try:
        for step in range(1, tcfg.steps + 1):
            x, y = data.samples((step - 1) * G, G)
            tw.write("train_x.i64", x)
            tw.write("train_y.i64", y)
            lr = learning_rate(step, tcfg.lr, tcfg.steps, tcfg.lr_schedule, tcfg.warmup_steps, tcfg.min_lr)
            loss = tw.ask(cmd="train", B=G, lr=lr)["loss"]
            if step % tcfg.eval_every == 0 or step == tcfg.steps:
                val = tw.ask(cmd="eval", n=tcfg.eval_batches, S=tcfg.eval_batch_size)["loss"]
                print(f"  step {step:>5}  train loss {loss:.4f}  validation loss {val:.4f}  "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        tw.close()
    return val


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--torch", required=True, metavar="PYTHON", help="a Python that has torch (a separate venv)")
    args, rest = p.parse_known_args(argv)
    try:
        s = settings_for(rest)
        if s.train.grad_accum != 1 and s.train.global_batch == 0:
            raise ConfigError("give the batch as --global-batch (the reference trains it as one batch)")
        val = reference(args.torch, s)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"final validation loss (torch): {val:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
