"""`--deterministic`: every floating-point reduction in a fixed order set by sample index, not by rank.

With a fixed global batch of G sequences and a fixed per-rank micro-batch of B sequences, the
step's losses, gradient norms, held-out losses, parameters and checkpoints are then bit-identical
for every layout ranks x grad_accum with ranks * grad_accum = G / B (1x4, 2x2, 4x1; 1x3, 3x1),
and across a resume on another world size. docs/deterministic.md has the scheme and the proof.

- A *block* is one micro-batch: B consecutive samples of the step. Block k starts at sample
  cursor + k*B (data.py puts rank r's micro-batch j at block k = j*world + r). Its gradient is
  computed alone into a zeroed flat buffer: the same inputs, shapes and code on one thread give
  the same bits whichever rank computes it.
- `Reducer.step`: every rank sends each of its blocks' shard slices to the shard owners (one
  Alltoall per block, right after its backward, so one gradient buffer serves every block; the
  received rows come out in block order k = j*world + q), and each
  owner sums the K = G/B rows of its shard in `tree_rows`' fixed tree over block indices. The sum
  is elementwise, so each element's result depends only on the K block values of that element:
  not on where the shard boundaries fall (which moves with the world size).
- The loss: every block's loss is allgathered and summed in the same tree over block indices.
- The gradient norm: sums of squares per fixed chunk of NORM_CHUNK values of the unpadded vector
  (chunk boundaries do not depend on the world size); chunks split between shards are assembled
  from the allgathered pieces; the chunk sums are added in a fixed tree over chunk indices.
- `HeldOutBlocks`: the held-out loss per fixed block of EVAL_ROWS rows, blocks dealt round-robin
  to the ranks, the block losses allgathered and tree-summed.
- Adam, clipping and the allgather of the parameters are elementwise or a copy: exact once their
  inputs are.

  mpirun -n 4 python -m capstone.deterministic bench [--repeats 3] [--reduction-only]
      the gradient reduction alone, then the step time of training runs, default vs deterministic
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time

import numpy as np
from mpi4py import MPI

from capstone.model.backward import value_and_grad_into
from capstone.checkpoint.digest import split_shard
from capstone.model.gpt import loss_sum
from capstone.parallel.zero import GradStats

NORM_CHUNK = 1 << 14   # values per chunk of the gradient norm's (and param_norm's) sum of squares
EVAL_ROWS = 4          # held-out rows per evaluation block


# ---- the fixed trees ---------------------------------------------------------------------------

def tree_rows(rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Sum rows[0..K-1] (K x S) into `out` in the fixed tree of pairs over row indices: at stride
    1, 2, 4, ... row i += row i+stride for i a multiple of 2*stride. Overwrites `rows`."""
    k = len(rows)
    stride = 1
    while stride < k:
        for i in range(0, k - stride, 2 * stride):
            np.add(rows[i], rows[i + stride], out=rows[i])
        stride *= 2
    out[...] = rows[0]
    return out


def tree_sum(values) -> float:
    """The same tree as `tree_rows` over a sequence of float64 scalars."""
    v = [float(x) for x in values]
    if not v:
        return 0.0
    stride = 1
    while stride < len(v):
        for i in range(0, len(v) - stride, 2 * stride):
            v[i] = v[i] + v[i + stride]
        stride *= 2
    return v[0]


def sumsq(values: np.ndarray) -> float:
    """Sum of squares of one chunk in float64 (squares of float32 are exact in float64; the sum is
    NumPy's pairwise sum, a function of the values and the length only)."""
    x = np.asarray(values, dtype=np.float64)
    return float(np.add.reduce(x * x))


def chunked_sumsq(full: np.ndarray, n: int, chunk: int = NORM_CHUNK) -> float:
    """Sum of squares of full[:n] over fixed chunks, summed in the fixed tree (serial reference)."""
    return tree_sum(sumsq(full[c:min(c + chunk, n)]) for c in range(0, n, chunk))


def fingerprint(flat: np.ndarray, n: int) -> tuple[float, str]:
    """(L2 norm, sha256 prefix) of the first n values (the parameters without the world-dependent
    padding), the norm in the fixed chunk tree: the same bits for the same parameters on any layout."""
    return math.sqrt(chunked_sumsq(flat, n)), hashlib.sha256(flat[:n].tobytes()).hexdigest()[:16]


# ---- the gradient ------------------------------------------------------------------------------

class ShardNorm:
    """The global L2 norm of a vector of n values sharded as [q*shard, (q+1)*shard) on rank q,
    the same bits on any number of ranks: chunk sums of squares where a rank holds whole chunks,
    the pieces of split chunks allgathered and joined, then the fixed tree over chunk indices."""

    def __init__(self, comm, n: int, shard: int, chunk: int = NORM_CHUNK):
        self.comm, self.n, self.chunk = comm, n, chunk
        self.rank, world = comm.Get_rank(), comm.Get_size()
        self.lo = self.rank * shard
        self.plans = [split_shard(q * shard, (q + 1) * shard, n, chunk) for q in range(world)]
        self.counts = [len(c) + sum(b - a for a, b in f) for c, f in self.plans]
        self.displs = list(np.cumsum([0] + self.counts[:-1]))
        self.recv = np.empty(sum(self.counts), dtype=np.float64)
        self.n_chunks = -(-n // chunk)

    def __call__(self, shard: np.ndarray) -> float:
        """Collective: call on all ranks with this rank's shard. Returns the norm (float64)."""
        complete, fragments = self.plans[self.rank]
        lo, chunk, n = self.lo, self.chunk, self.n
        send = [np.array([sumsq(shard[c * chunk - lo:min((c + 1) * chunk, n) - lo]) for c in complete])]
        send += [shard[a - lo:b - lo].astype(np.float64) for a, b in fragments]
        send = np.concatenate(send)
        self.comm.Allgatherv(send, [self.recv, self.counts, self.displs, MPI.DOUBLE])
        sums, pieces = {}, {}
        for (complete, fragments), at in zip(self.plans, self.displs):
            for c in complete:
                sums[c] = float(self.recv[at])
                at += 1
            for a, b in fragments:
                pieces.setdefault(a // chunk, []).append((a, self.recv[at:at + b - a]))
                at += b - a
        for c, parts in pieces.items():
            sums[c] = sumsq(np.concatenate([p for _, p in sorted(parts, key=lambda t: t[0])]))
        if sorted(sums) != list(range(self.n_chunks)):
            raise RuntimeError(f"deterministic norm: chunks {sorted(set(range(self.n_chunks)) - set(sums))} missing")
        return math.sqrt(tree_sum(sums[c] for c in range(self.n_chunks)))


class Reducer:
    """Forward+backward per block and the fixed-order ZeRO-1 reduction that replaces
    `Model.forward_backward` + `ZeroAdam.reduce_gradients` under --deterministic."""

    def __init__(self, comm, model, opt, grad_accum: int):
        layout = model.layout
        self.comm, self.model, self.opt = comm, model, opt
        self.world, self.accum = comm.Get_size(), grad_accum
        # row k = j*world + q: rank q's block j, this rank's shard of it (block k of the step)
        self.rows = np.empty((grad_accum * self.world, layout.shard), dtype=np.float32)
        self.norm = ShardNorm(comm, layout.n_params, layout.shard)

    def nbytes(self) -> int:
        """Bytes this mode adds to a rank: the received rows (grad_accum x the flat buffer)."""
        return self.rows.nbytes

    def step(self, batches, scale: float, extras=(), poison=None) -> GradStats:
        """Collective: call on all ranks with this rank's micro-batches (j = 0..grad_accum-1, block
        j*world + rank). Leaves the tree-summed gradient shard in `opt.g_shard`; returns its norm and
        extras = [tree-summed loss, *caller's extras summed over ranks] like `reduce_gradients`."""
        m, w = self.model, self.world
        losses, comm_s = [], 0.0
        for j, (x, y) in enumerate(batches):   # each block alone, overwriting the gradient buffer
            losses.append(value_and_grad_into(loss_sum, m.groups, m.grad_groups, x, y, m.cfg, scale, fresh=True))
            if poison is not None and j == 0:
                poison(m.grads)
            t0 = time.perf_counter()
            self.comm.Alltoall(m.grads, self.rows[j * w:(j + 1) * w])   # slice q of the buffer to rank q
            comm_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = self.reduce(losses, extras)
        self.opt.timings["reduce_scatter"] = comm_s + time.perf_counter() - t0
        return stats

    def reduce(self, losses, extras=()) -> GradStats:
        """Collective: the owner's tree over the received rows, the loss tree and the norm."""
        w = self.world
        tree_rows(self.rows, self.opt.g_shard)
        small = np.array([*losses, *extras], dtype=np.float64)
        every = np.empty((w, len(small)), dtype=np.float64)
        self.comm.Allgather(small, every)
        loss = tree_sum(every[:, :self.accum].T.reshape(-1))   # index j*w + q = block k
        norm = self.norm(self.opt.g_shard)
        return GradStats(norm, np.array([loss, *every[:, self.accum:].sum(axis=0)]))


# ---- the held-out evaluation -------------------------------------------------------------------

class HeldOutBlocks:
    """The held-out loss in fixed blocks of EVAL_ROWS rows of each held-out batch (block b to rank
    b % world). `loss_share` is a collective that returns the tree-summed mean loss per token on
    rank 0 and 0.0 elsewhere, so the caller's sum over ranks adds exact zeros to it."""

    def __init__(self, data, batches: int, batch_size: int, seq_len: int, comm):
        self.comm, self.rank, self.world = comm, comm.Get_rank(), comm.Get_size()
        self.scale = 1.0 / (batches * batch_size * seq_len)
        spans = [(k, a, min(a + EVAL_ROWS, batch_size)) for k in range(batches) for a in range(0, batch_size, EVAL_ROWS)]
        self.n_blocks = len(spans)
        mine = spans[self.rank::self.world]
        full = {k: data.val_batch(k, batch_size) for k in {k for k, _, _ in mine}}
        self.blocks = [(full[k][0][a:b].copy(), full[k][1][a:b].copy()) for k, a, b in mine]
        self.per_rank = -(-self.n_blocks // self.world)

    def loss_share(self, model) -> float:
        local = np.zeros(self.per_rank, dtype=np.float64)
        for i, (x, y) in enumerate(self.blocks):
            local[i] = model.loss(x, y, self.scale)
        every = np.empty((self.world, self.per_rank), dtype=np.float64)
        self.comm.Allgather(local, every)
        total = tree_sum(every.T.reshape(-1)[:self.n_blocks])   # index i*world + q = block b
        return total if self.rank == 0 else 0.0


# ---- the cost ----------------------------------------------------------------------------------

def bench(args) -> int:
    """Collective: run under mpirun. Step time of default vs --deterministic runs, reference and medium."""
    import contextlib
    import io
    import json
    import os
    import shutil
    import statistics
    import tempfile

    from capstone.parallel.dist import Dist
    from capstone.run import open_run
    from capstone import cli, train
    from capstone.runtime import heap

    dist = Dist()
    heap.keep_freed_memory()
    reduction(dist, 20)
    if args.reduction_only:
        return 0
    tmp = dist.bcast_json(tempfile.mkdtemp(prefix="capstone-det-bench-") if dist.rank == 0 else None)
    sizes = [("reference", ["--steps", str(args.reference_steps)]),
             ("medium", ["--preset", "medium", "--steps", str(args.medium_steps), "--eval-every", "1000"])]
    common = ["--quiet", "--ckpt-every", "0", "--ckpt-every-minutes", "0"]
    modes = ("default", "deterministic")
    rows = {(name, mode): [] for name, _ in sizes for mode in modes}
    for name, flags in sizes:
        for rep in range(args.repeats):      # the modes interleaved, so drift in the machine's load hits both
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                out = os.path.join(tmp, f"{name}-{mode}-{rep}")
                argv = flags + common + ["--out", out] + (["--deterministic"] if mode == "deterministic" else [])
                run = open_run(dist, cli.parse(argv))
                with contextlib.redirect_stdout(io.StringIO()):
                    train.train(run)
                if dist.rank == 0:
                    with open(os.path.join(out, "metrics.jsonl")) as f:
                        rows[(name, mode)] += [r for r in map(json.loads, f) if r.get("step", 0) >= 2]
    if dist.rank == 0:
        print(f"step time on {dist.world} ranks, default vs --deterministic (rank 0, median ms over steps 2.. of "
              f"{args.repeats} runs each; reference {args.reference_steps} steps, medium {args.medium_steps} steps):")
        print(f"  {'size':<10} {'mode':<14} {'step':>9} {'fwd_bwd':>9} {'reduce':>9} {'ratio':>6}")
        for name, _ in sizes:
            base = statistics.median(r["step_ms"] for r in rows[(name, "default")])
            for mode in modes:
                med = {k: statistics.median(r[k] for r in rows[(name, mode)])
                       for k in ("step_ms", "fwd_bwd_ms", "reduce_scatter_ms")}
                print(f"  {name:<10} {mode:<14} {med['step_ms']:>9.2f} {med['fwd_bwd_ms']:>9.2f} "
                      f"{med['reduce_scatter_ms']:>9.2f} {med['step_ms'] / base:>6.2f}")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def reduction(dist, repeats: int) -> None:
    """Collective. The phase the mode replaces, alone (no forward/backward, so less noise): the
    gradient reduction and norm, default vs deterministic, at the reference and medium sizes."""
    from capstone.config import ModelConfig
    from capstone.model.gpt import Model
    from capstone.model.params import Layout, init_params
    from capstone.presets import PRESETS
    from capstone.parallel.zero import ZeroAdam
    medium = {k: v for k, v in PRESETS["medium"].items() if k in ModelConfig.__dataclass_fields__}
    if dist.rank == 0:
        print(f"gradient reduction + norm alone on {dist.world} ranks, grad_accum 1 (best of {repeats}, ms):")
    for name, cfg in (("reference", ModelConfig()), ("medium", ModelConfig(**medium))):
        layout = Layout.for_model(cfg, dist.world)
        model = Model(cfg, layout, init_params(layout, cfg, 0))
        opt = ZeroAdam(dist.comm, layout, model.params, model.grads)
        det = Reducer(dist.comm, model, opt, 1)
        model.grads[:layout.n_params] = np.random.default_rng(dist.rank).standard_normal(layout.n_params) * 1e-3

        def deterministic():
            dist.comm.Alltoall(model.grads, det.rows)
            det.reduce([0.5], [0.0, 0.0])

        best = {}
        for label, fn in (("default", lambda: opt.reduce_gradients([0.5, 0.0, 0.0])), ("deterministic", deterministic)):
            times = []
            for _ in range(repeats):
                dist.barrier()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best[label] = 1e3 * min(times)
        if dist.rank == 0:
            print(f"  {name:<10} {layout.n_params:>9} params: default {best['default']:8.2f}, "
                  f"deterministic {best['deterministic']:8.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m capstone.deterministic", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="step time, default vs --deterministic (run under mpirun)")
    b.add_argument("--reference-steps", type=int, default=10)
    b.add_argument("--medium-steps", type=int, default=4)
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--reduction-only", action="store_true", help="only the reduction phase, without training runs")
    args = p.parse_args(argv)
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
