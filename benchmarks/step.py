"""Benchmarks of one rank's training step, single-threaded, at three model sizes.

`speed`: capstone's step against PyTorch eager's (benchmarks/torch_model.py), interleaved, with the
share of the step in BLAS; `memory`: peak and per-step RSS at medium against the computed budget;
`checks`: what train.py's per-step checks add at medium. Run through `python -m benchmarks.bench`.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from benchmarks.torch_worker import TorchWorker

# ---- the single-thread training step: capstone (and PyTorch eager) at three sizes -----------------

# (name, model config, sequences per step): the sizes of issue 11's table (medium as the `medium`
# preset but with V 256, large the next size up).
SIZES = {
    "reference": (dict(), 4),
    "medium": (dict(vocab_size=256, seq_len=128, d_model=256, n_heads=8, n_layers=4), 8),
    "large": (dict(vocab_size=512, seq_len=256, d_model=512, n_heads=8, n_layers=6), 8),
}
# Optimiser of the `medium` preset (AdamW, decay on matrices and embeddings, clip at 1), at a fixed lr.
OPT = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1, "clip": 1.0}


def _load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def _status_kib(*keys: str) -> list[int]:
    """Fields of /proc/self/status in KiB (VmHWM: peak RSS; RssFile: file-backed pages, the mapped
    libraries, which every rank on a node shares through the page cache)."""
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return [int(d[k].split()[0]) for k in keys]


class Stepper:
    """One rank's training step as train.py runs it (world 1, one thread): forward+backward into the
    flat gradient buffer, ZeRO-1 reduce (norm), clip, AdamW, publish."""

    def __init__(self, size: str, seed: int = 0):
        from capstone.config import ModelConfig
        from capstone.data.synthetic import DataStream, make_corpus
        from capstone.step.hooks import NONE
        from capstone.model.gpt import Model
        from capstone.model.params import Layout, init_params
        from capstone.collective import launch
        from capstone.parallel.buckets import BucketReducer
        from capstone.parallel.grid import Grid
        from capstone.parallel.schedules import Sequential
        from capstone.parallel.zero import ZeroAdam
        kw, self.B = SIZES[size]
        self.cfg = ModelConfig(**kw)
        self.layout = Layout.for_model(self.cfg, 1)
        self.grid = Grid.build(launch.serial())
        self.model = Model.over(self.cfg, self.layout, init_params(self.layout, self.cfg, seed))
        self.reducer = BucketReducer(self.grid, self.layout, self.model.grads, self.layout.padded)   # one bucket
        self.opt = ZeroAdam(self.grid.dp, self.layout, self.model.params, OPT["betas"], OPT["eps"],
                            OPT["weight_decay"], OPT["clip"])
        self.schedule = Sequential(self.model, self.reducer, NONE, 1.0)
        self.stream = DataStream(make_corpus(0, 1 << 16, self.cfg.vocab_size), self.cfg.seq_len, self.B, 0,
                                 eval_sequences=64)  # room for the `medium` preset's held-out set
        self.x, self.y = self.stream.samples(0, self.B)

    def step(self, x=None, y=None) -> tuple[float, float, float]:
        """(wall ms, CPU ms, loss) of one training step on (x, y) (default: the fixed batch)."""
        from capstone.parallel.reduce import Flags
        x, y = (self.x, self.y) if x is None else (x, y)
        t, c = time.perf_counter(), time.process_time()
        self.schedule.scale = 1.0 / x.size
        losses = self.schedule.forward_backward([(x, y)], 1)
        stats = self.reducer.finish(losses, Flags())
        self.opt.apply(self.reducer.grad_shard, OPT["lr"], stats.norm)     # clipped to OPT["clip"] inside
        return 1e3 * (time.perf_counter() - t), 1e3 * (time.process_time() - c), losses[0]


def _agreement(st: Stepper, tw: TorchWorker) -> str:
    """Loss and every gradient array of one forward+backward (before any update), capstone vs torch."""
    import numpy as np
    loss = st.model.forward_backward([(st.x, st.y)], 1.0 / st.x.size)
    tloss, tflat = tw.grads()
    worst, worst_name = 0.0, ""
    for name, a in st.layout.views(st.model.grads).items():
        b = st.layout.views(tflat)[name]
        err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
        if err > worst:
            worst, worst_name = err, name
    ok = abs(loss - tloss) <= 1e-5 * abs(tloss) and worst <= 1e-3
    return (f"loss {loss:.6f} vs {tloss:.6f} (rel {abs(loss - tloss) / abs(tloss):.1e}); every gradient array: "
            f"max|capstone - torch| / max|torch| <= {worst:.1e} (worst {worst_name}) -> "
            f"{'agree' if ok else 'DISAGREE'} (tolerance: loss 1e-5 rel, gradients 1e-3)")


def _matmul_share(st: Stepper, tw: TorchWorker | None, steps: int) -> str:
    """The share of capstone's step in its kernels' matmul calls (a timed wrapper); with torch, the
    share of torch's step in its linear layers' matmuls (torch.profiler) and what 0.85x would leave."""
    from capstone.model import kernels
    seconds = [0.0]

    def timed(a, b, out=None):   # every kernel matmul goes through kernels._mm
        t = time.process_time()
        r = np.matmul(a, b, out=out)
        seconds[0] += time.process_time() - t
        return r
    kernels._mm = timed
    try:
        total = sum(st.step()[1] for _ in range(steps)) / 1e3
    finally:
        kernels._mm = np.matmul
    mm = seconds[0]
    line = (f"    capstone: {mm / total:.1%} of its step in the kernels' matmul calls, attention's included "
            f"({1e3 * mm / steps:.1f} of {1e3 * total / steps:.1f} ms; timed wrapper, {steps} steps)")
    if tw:
        rep = tw.ask(cmd="profile", n=steps)
        share = rep["mm_ms"] / rep["ms"]
        line += (f"\n    torch:    {share:.1%} of its step in aten::mm/addmm, its linear layers alone ({rep['mm_ms']:.1f} "
                 f"of {rep['ms']:.1f} ms under torch.profiler, {steps} steps): with linear layers as fast as "
                 f"torch's, 0.85x leaves {0.85 - share:.0%} of torch's step for all the rest, where torch takes "
                 f"{1 - share:.0%}")
    return line


def _pin_to_one_cpu() -> str:
    """Pin this process, and so the torch worker it starts, to its current CPU: capstone and torch
    then share one core's clock, caches and neighbours (on a shared VM, two cores can differ by 30%)."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return "one CPU"
    cpu = os.sched_getcpu() if hasattr(os, "sched_getcpu") else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"capstone and torch both pinned to CPU {cpu}"


def speed(sizes: list[str], repeats: dict, torch_python: str | None, blas_steps: int) -> int:
    """Median single-thread step (forward+backward+reduce+clip+AdamW) at each size; capstone and
    torch steps alternate (ABBA) within one process pair, so both see the same machine load.
    Each step is timed twice: wall clock, and CPU time of the process (time.process_time), which
    leaves out the time the process waits for a core on a shared machine; the ratio is of CPU times."""
    bad = 0
    cpu = _pin_to_one_cpu()
    print(f"single-thread training step (forward+backward, ZeRO-1 reduce, clip, AdamW), float32, median ms of "
          f"CPU time [wall time]; {_load()}; {cpu}")
    for size in sizes:
        st = Stepper(size)
        tw = TorchWorker(torch_python, st.cfg, st.layout, st.model.params, (st.x, st.y), OPT) if torch_python else None
        n = repeats[size]
        cfg = st.cfg
        head = (f"  {size:<9} C{cfg.d_model} H{cfg.n_heads} L{cfg.n_layers} T{cfg.seq_len} B{st.B} V{cfg.vocab_size} "
                f"({st.layout.n_params} params)")
        if tw:
            agree = _agreement(st, tw)
            bad += "DISAGREE" in agree
        for _ in range(2):  # warm-up: heap, caches, BLAS buffers
            st.step()
            tw and tw.ask(cmd="step")
        mine, theirs, lc, lt = [], [], 0.0, 0.0
        for r in range(n):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for who in order:
                if who == 0:
                    wall, cpu, lc = st.step()
                    mine.append((cpu, wall))
                elif tw:
                    rep = tw.ask(cmd="step")
                    theirs.append((rep["cpu_ms"], rep["ms"]))
                    lt = rep["loss"]
        med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
        print(head, flush=True)
        line = f"    capstone {med(mine, 0):9.2f} [{med(mine, 1):9.2f}]"
        if tw:
            line += (f"   torch {tw.info['torch']} eager {med(theirs, 0):9.2f} [{med(theirs, 1):9.2f}]   "
                     f"ratio {med(mine, 0) / med(theirs, 0):.2f}x [{med(mine, 1) / med(theirs, 1):.2f}x]   "
                     f"({n} interleaved steps each)")
        else:
            line += f"   ({n} steps)"
        print(line, flush=True)
        if tw:
            print(f"    {agree}")
            print(f"    loss after {n + 2} steps: capstone {lc:.6f}, torch {lt:.6f}")
        if size != "reference" and blas_steps:
            print(_matmul_share(st, tw, blas_steps if size == "medium" else max(2, blas_steps // 4)), flush=True)
        if tw:
            tw.close()
        del st
    print(f"  ({_load()})")
    return 1 if bad else 0


# ---- memory ------------------------------------------------------------------------------------

def activation_bytes(st: Stepper) -> tuple[int, int]:
    """(bytes the autograd graph holds at the end of the forward pass, peak bytes allocated during
    forward+backward) of one micro-batch as the step runs it, by tracemalloc (NumPy reports its
    buffers to it)."""
    import tracemalloc

    held = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _, backward = st.model.forward(st.x, st.y, 1.0 / st.x.size, fresh=True)
        held.append(tracemalloc.get_traced_memory()[0] - base)
        backward()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return held[0], peak


def memory(steps: int) -> None:
    """RSS of one rank training at medium: at steps 10 and `steps` (growth), and the peak (all of
    it, and its private part) against params + grads + optimizer state + activations."""
    rss0, file0 = (1024 * kib for kib in _status_kib("VmRSS", "RssFile"))
    st = Stepper("medium")
    held, peak_alloc = activation_bytes(st)
    m, opt = st.model, st.opt
    parts = {"params": m.params.nbytes, "grads": m.grads.nbytes + st.reducer.grad_shard.nbytes,
             "optimizer state": opt.state.nbytes + opt.before_nbytes(), "activations": held}
    budget = sum(parts.values())
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"memory of one rank at medium (C256 H8 L4 T128 B8 V256), {steps} training steps; {_load()}")
    print("  " + ", ".join(f"{k} {mib(v)}" for k, v in parts.items()) + f" MiB: sum {mib(budget)} MiB (the optimizer "
          f"state is ZeroAdam's shard state, {mib(opt.state.nbytes)}, and the spare it writes the update into, "
          f"which keeps the state before the last update for the guard's undo)")
    print(f"  forward+backward allocates at most {mib(peak_alloc)} MiB at once (activations + backward "
          f"temporaries, tracemalloc)")
    rss = {}
    for s in range(1, steps + 1):
        x, y = st.stream.samples(s * st.B, st.B)
        st.step(x, y)
        if s in (10, steps):
            rss[s] = 1024 * _status_kib("VmRSS")[0]
    peak, file1 = (1024 * kib for kib in _status_kib("VmHWM", "RssFile"))
    private = peak - min(file0, file1)  # at least the private part of the peak
    print(f"  RSS: before the model {mib(rss0)} MiB (interpreter, NumPy, MPI; {mib(file0)} of it mapped "
          f"files), step 10 {mib(rss[10])} MiB, step {steps} {mib(rss[steps])} MiB (growth "
          f"{(rss[steps] - rss[10]) / 2**20:+.1f} MiB)")
    print(f"  peak RSS {mib(peak)} MiB = {peak / budget:.2f}x the sum; of it private (not the mapped libraries "
          f"and files, {mib(file1)} MiB, which all ranks on a node share) at most {mib(private)} MiB = "
          f"{private / budget:.2f}x the sum; peak less the whole pre-model RSS {mib(peak - rss0)} MiB = "
          f"{(peak - rss0) / budget:.2f}x")


# ---- train.py's per-step checks ----------------------------------------------------------------

def checks(repeats: int) -> None:
    """What train_step adds to a step at medium: the replica fingerprint (float64 norm + word sum,
    or + sha256 on evaluation steps), the update's finiteness check, and the held-out evaluation
    (the `medium` preset's sequences, forward only) on evaluation steps."""
    from capstone.data.heldout import HeldOut
    from capstone.model.fingerprint import fingerprint, sum_squares, word_sum
    from capstone.flags.presets import PRESETS
    st = Stepper("medium")
    pre = PRESETS["medium"]
    heldout = HeldOut(st.stream, pre["eval_batches"], pre["eval_batch_size"], st.cfg.seq_len, st.grid.world, 0, 1,
                      st.model.loss)
    flat = st.model.params

    def med(fn, n=repeats):
        ts = []
        for _ in range(n):
            t = time.process_time()
            fn()
            ts.append(time.process_time() - t)
        return 1e3 * statistics.median(ts)
    st.step()
    step = statistics.median(st.step()[1] for _ in range(max(3, repeats // 4)))
    cheap, strong = med(lambda: fingerprint(flat, strong=False)), med(lambda: fingerprint(flat))
    norm, words = med(lambda: sum_squares(flat)), med(lambda: word_sum(flat))
    finite = med(st.opt.state.finite)
    ev = med(lambda: heldout.loss_share(), max(3, repeats // 4))
    every = pre["eval_every"]
    print(f"train.py's checks at medium ({st.layout.n_params} params, {flat.nbytes / 2**20:.1f} MiB), median ms of CPU time; {_load()}")
    print(f"  training step {step:.1f}")
    print(f"  fingerprint between evaluations {cheap:.2f} ({cheap / step:.1%} of a step): float64 norm {norm:.2f}, "
          f"word sum {words:.2f}; on evaluation steps (sha256) {strong:.2f}")
    print(f"  finiteness of master, m, v after the update {finite:.2f} ({finite / step:.1%})")
    print(f"  held-out eval ({pre['eval_batches']} x {pre['eval_batch_size']} sequences, forward) {ev:.1f} "
          f"= {ev / step:.2f} steps; every {every} steps: {ev / every / step:.1%} of a step on average")
