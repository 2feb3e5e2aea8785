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
  python -m benchmarks.nanogpt table --steps 2000 --cores 2 LABEL:WALL:CPU:LOAD:LOG ...
  python -m benchmarks.nanogpt profile --batch 6                  # capstone's step, one rank's share of 2
  TORCH_PYTHON -m benchmarks.nanogpt profile-torch NANOGPT_DIR --batch 6 --threads 1   # nanoGPT's model

`profile` times one rank's step (forward+backward, reduction, AdamW; `benchmarks.step.Stepper`, world 1,
one thread, the training process's heap setting) at the preset's shape, CPU time, and splits it by kernel
(cProfile on the CPU clock; matmuls by a timed `kernels._mm`). `profile-torch` does the same for nanoGPT's
GPT (its model.py, bias=False as its train.py) with its configure_optimizers' AdamW under torch.profiler.
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
        print(f"NANOGPT_DIR={nanogpt}: not a nanoGPT checkout (no {', '.join(missing)}); give the directory of a "
              "clone of https://github.com/karpathy/nanoGPT", file=sys.stderr)
        raise SystemExit(2)
    os.makedirs(os.path.join(out, "data", "shakespeare_char"), exist_ok=True)
    for f in ("train.py", "model.py", "configurator.py", "config"):
        os.symlink(os.path.abspath(os.path.join(nanogpt, f)), os.path.join(out, f))
    with open(os.path.join(data, "meta.json")) as fh:
        meta = json.load(fh)
    if meta["tokenizer"]["kind"] != "char" or meta["dtype"] != "uint16-le":
        print(f"{data}: nanoGPT's shakespeare_char needs character tokens in uint16-le", file=sys.stderr)
        raise SystemExit(2)
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
    """Each run's wall, job CPU and final validation loss, the ratio of the mean walls and the FLOP floor.
    A run is LABEL:WALL:CPU:LOAD:LOG (LOAD: the 1-minute load average at its start)."""
    seconds, peak = floor(steps, cores)
    walls: dict[str, list[float]] = {}
    vals: dict[str, list[float]] = {}
    for run in runs:
        label, wall, cpu, load_, log = run.split(":", 4)
        kind = "nanoGPT" if label.startswith("nanogpt") else f"capstone {label}"
        walls.setdefault(kind, []).append(float(wall))
        vals.setdefault(kind, []).append(final_val(label, log))
        print(f"  {kind:<14} wall {float(wall):6.1f} s  job CPU {float(cpu):6.1f} s  load at start {load_:>5}  "
              f"final val loss {vals[kind][-1]:.4f}")
    gflop = steps * step_flops(**SHAPE) / 1e9
    print(f"  FLOP floor: {gflop:,.0f} GFLOP of training steps at {peak:.1f} GFLOP/s per core (sgemm at the model's "
          f"shapes, this core) x {cores} cores = {seconds:.1f} s")
    ref = statistics.mean(walls.get("nanoGPT", [float("nan")]))
    for kind in walls:
        w = statistics.mean(walls[kind])
        print(f"  {kind:<14} mean wall {w:6.1f} s = {w / ref:.3f}x nanoGPT = {w / seconds:.2f}x the floor; "
              f"final val {statistics.mean(vals[kind]):.4f}")


CATEGORIES = {   # kernel functions of capstone.model (cumulative CPU time, their matmuls included)
    "attention (fwd+bwd)": ("_attention_fwd", "_attention_bwd"),
    "LayerNorm (fwd+bwd)": ("_ln_fwd", "_ln_bwd"),
    "GELU (fwd+bwd)": ("_gelu_fwd", "_gelu_grad"),
    "cross-entropy, embedding": ("_xent_fwd", "_xent_grad_inplace", "_embed_fwd", "_embed_bwd"),
    "AdamW (ZeRO shard)": ("_adam_chunk",),
}


def profile(batch: int, steps: int = 200) -> None:
    """capstone's step at the preset's shape with `batch` sequences (see the module's docstring)."""
    import cProfile
    import pstats

    from benchmarks import step as bench_step
    from capstone.model import kernels
    from capstone.runtime import heap
    heap.keep_freed_memory()
    bench_step.SIZES["shakespeare-char"] = (dict(vocab_size=84, seq_len=64, d_model=128, n_heads=4, n_layers=4), batch)
    st = bench_step.Stepper("shakespeare-char")
    for _ in range(20):
        st.step()
    timed_steps = [st.step() for _ in range(steps)]
    cpu = statistics.median(t[1] for t in timed_steps)
    walls = sorted(t[0] for t in timed_steps)
    mm = [0.0]

    def timed(a, b, out=None):
        t = time.process_time()
        r = np.matmul(a, b, out=out)
        mm[0] += time.process_time() - t
        return r
    kernels._mm = timed
    total = sum(st.step()[1] for _ in range(steps)) / 1e3
    kernels._mm = np.matmul
    prof = cProfile.Profile(time.process_time)
    prof.runcall(lambda: [st.step() for _ in range(steps)])
    stats = pstats.Stats(prof).stats
    profiled = max(v[3] for k, v in stats.items() if k[2] == "step")
    print(f"capstone, batch {batch} (one rank's step), {load()}: step {cpu:.2f} ms CPU (median of {steps}), "
          f"wall min {walls[0]:.2f} median {walls[len(walls) // 2]:.2f} ms; matmuls (kernels._mm, attention's included) {1e3 * mm[0] / steps:.2f} ms = {mm[0] / total:.1%}")
    print(f"  under cProfile (CPU clock, {1e3 * profiled / steps:.2f} ms a step with its overhead), cumulative:")
    for name, funcs in CATEGORIES.items():
        sec = sum(v[3] for k, v in stats.items() if k[2] in funcs)
        print(f"    {name:<26} {1e3 * sec / steps:6.2f} ms  {sec / profiled:6.1%}")


def profile_torch(nanogpt: str, batch: int, threads: int, steps: int = 100) -> None:
    """nanoGPT's model and AdamW at the same shape under torch.profiler (see the module's docstring)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile
    sys.path.insert(0, os.path.abspath(nanogpt))
    from model import GPT, GPTConfig   # nanoGPT's model.py, from its checkout
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    C = SHAPE["d_model"]
    m = GPT(GPTConfig(block_size=SHAPE["seq_len"], vocab_size=SHAPE["vocab"], n_layer=SHAPE["n_layers"],
                      n_head=4, n_embd=C, dropout=0.0, bias=False))
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    x, y = (torch.randint(0, SHAPE["vocab"], (batch, SHAPE["seq_len"])) for _ in range(2))

    def step():
        _, loss = m(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(20):
        step()
    cpu = []
    for _ in range(steps):
        t = time.process_time()
        step()
        cpu.append(1e3 * (time.process_time() - t))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"nanoGPT's model (torch {torch.__version__}, {threads} thread(s)), batch {batch}, {load()}: "
          f"step {statistics.median(cpu):.2f} ms CPU (median of {steps}); torch.profiler, self CPU shares:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
        print(f"    {e.key[:48]:<48} {e.self_cpu_time_total / total:6.1%}  ({e.count // steps} calls a step)")


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


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
            s.add_argument("runs", nargs="+", metavar="LABEL:WALL:CPU:LOAD:LOG")
    pr = sub.add_parser("profile")
    pr.add_argument("--batch", type=int, default=6)
    pt = sub.add_parser("profile-torch")
    pt.add_argument("nanogpt"), pt.add_argument("--batch", type=int, default=6)
    pt.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.cmd == "profile":
        profile(a.batch)
    elif a.cmd == "profile-torch":
        profile_torch(a.nanogpt, a.batch, a.threads)
    elif a.cmd == "workdir":
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
