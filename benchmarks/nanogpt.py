"""capstone's shakespeare-char preset against nanoGPT's own train.py: the parts of scripts/bench-shakespeare.

nanoGPT is not on PyPI: the bench takes a checkout (NANOGPT_DIR) and never copies its code. `workdir` makes a
directory that nanoGPT's train.py runs in: links to the checkout's train.py, model.py, configurator.py and
config/, and data/shakespeare_char/{train,val}.bin linked to capstone's prepared dataset (the same corpus,
uint16 little-endian tokens, which is what nanoGPT's memmap reads) with the meta.pkl nanoGPT's prepare.py
would write (vocab_size, stoi, itos of capstone's character vocabulary). Writing that pickle is for nanoGPT
only; capstone never reads one. `floor` measures this core's single-thread sgemm peak at the model's matmul
shapes and prints the FLOP floor of the run's training steps on the given cores. `table` reads the logs of
the ABA runs and prints wall, final validation loss and the ratio.

  python -m benchmarks.nanogpt workdir NANOGPT_DIR DATA_DIR OUT
  python -m benchmarks.nanogpt floor --steps 2000 --cores 2
  python -m benchmarks.nanogpt table --steps 2000 --cores 2 LABEL:WALL:LOG ...
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import sys
import time

import numpy as np

# nanoGPT's README command for its CPU baby GPT (the shakespeare-char preset is defined as this model).
NANOGPT_ARGS = ("config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 "
                "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters={steps} "
                "--lr_decay_iters={steps} --dropout=0.0 --eval_interval={every}")
SHAPE = dict(n_layers=4, d_model=128, seq_len=64, vocab=84, batch=12)


def workdir(nanogpt: str, data: str, out: str) -> None:
    """The directory nanoGPT's train.py runs in (see the module's docstring)."""
    missing = [f for f in ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
               if not os.path.exists(os.path.join(nanogpt, f))]
    if missing:
        sys.exit(f"NANOGPT_DIR={nanogpt}: not a nanoGPT checkout (no {', '.join(missing)}); "
                 "e.g. git clone https://github.com/karpathy/nanoGPT")
    os.makedirs(os.path.join(out, "data", "shakespeare_char"), exist_ok=True)
    for f in ("train.py", "model.py", "configurator.py", "config"):
        os.symlink(os.path.abspath(os.path.join(nanogpt, f)), os.path.join(out, f))
    with open(os.path.join(data, "meta.json")) as fh:
        meta = json.load(fh)
    if meta["tokenizer"]["kind"] != "char" or meta["dtype"] != "uint16-le":
        sys.exit(f"{data}: nanoGPT's shakespeare_char needs character tokens in uint16-le")
    chars = meta["tokenizer"]["chars"]
    target = os.path.join(out, "data", "shakespeare_char")
    for split in ("train", "val"):
        os.symlink(os.path.abspath(os.path.join(data, meta["splits"][split]["file"])),
                   os.path.join(target, f"{split}.bin"))
    with open(os.path.join(target, "meta.pkl"), "wb") as fh:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, fh)


def step_flops(n_layers: int, d_model: int, seq_len: int, vocab: int, batch: int) -> float:
    """FLOPs of one training step (forward + backward), nanoGPT's estimate_mfu count: 6 per matmul
    weight and token, plus 12 L C T per token for attention's two (T, T) products (unmasked)."""
    weights = n_layers * 12 * d_model * d_model + d_model * vocab
    return batch * seq_len * (6 * weights + 12 * n_layers * d_model * seq_len)


def sgemm_peak(rows: int = 384) -> float:
    """This core's single-thread sgemm GFLOP/s: the best of the model's four block matmuls at `rows`."""
    rng = np.random.default_rng(0)
    best = 0.0
    C = SHAPE["d_model"]
    for k, n in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):
        x = rng.standard_normal((rows, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
        for _ in range(200):
            t = time.perf_counter()
            x @ w
            best = max(best, 2 * rows * k * n / (time.perf_counter() - t) / 1e9)
    return best


def floor(steps: int, cores: int) -> tuple[float, float]:
    """(seconds, GFLOP/s per core): the training steps' FLOPs at the sgemm peak on `cores` cores."""
    peak = sgemm_peak()
    return steps * step_flops(**SHAPE) / (cores * peak * 1e9), peak


def final_val(label: str, log: str) -> float:
    """The last validation loss of a run's log: nanoGPT's `step N: ... val loss X` line, or capstone's
    summary.json (`log` is then the run directory)."""
    if label.startswith("nanogpt"):
        with open(log) as fh:
            return float(re.findall(r"val loss ([0-9.]+)", fh.read())[-1])
    with open(os.path.join(log, "summary.json")) as fh:
        return json.load(fh)["held_out"]["final"]


def table(steps: int, cores: int, runs: list[str]) -> None:
    """Each run's wall and final validation loss, the ratio of the means and the FLOP floor."""
    seconds, peak = floor(steps, cores)
    walls: dict[str, list[float]] = {}
    vals: dict[str, list[float]] = {}
    for run in runs:
        label, wall, log = run.split(":", 2)
        kind = "nanoGPT" if label.startswith("nanogpt") else f"capstone {label}"
        walls.setdefault(kind, []).append(float(wall))
        vals.setdefault(kind, []).append(final_val(label, log))
        print(f"  {kind:<20} wall {float(wall):7.1f} s   final val loss {vals[kind][-1]:.4f}")
    gflop = steps * step_flops(**SHAPE) / 1e9
    print(f"  FLOP floor: {gflop:,.0f} GFLOP of training steps at {peak:.1f} GFLOP/s per core (sgemm, this core) "
          f"x {cores} cores = {seconds:.1f} s")
    ref = statistics.mean(walls.get("nanoGPT", [float("nan")]))
    for kind in walls:
        w = statistics.mean(walls[kind])
        print(f"  {kind:<20} mean wall {w:7.1f} s = {w / ref:.3f}x nanoGPT, {w / seconds:.2f}x the floor; "
              f"final val {statistics.mean(vals[kind]):.4f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("workdir")
    w.add_argument("nanogpt"), w.add_argument("data"), w.add_argument("out")
    for name in ("floor", "table", "args"):
        s = sub.add_parser(name)
        s.add_argument("--steps", type=int, default=2000)
        s.add_argument("--cores", type=int, default=os.cpu_count())
        if name == "table":
            s.add_argument("runs", nargs="+", metavar="LABEL:WALL:LOG")
    a = p.parse_args(argv)
    if a.cmd == "workdir":
        workdir(a.nanogpt, a.data, a.out)
    elif a.cmd == "args":
        # the config's eval_interval (250) when it divides the steps, so that the last step is evaluated
        print(NANOGPT_ARGS.format(steps=a.steps, every=250 if a.steps % 250 == 0 else a.steps))
    elif a.cmd == "floor":
        seconds, peak = floor(a.steps, a.cores)
        print(f"{seconds:.1f} s ({peak:.1f} GFLOP/s per core)")
    else:
        table(a.steps, a.cores, a.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
