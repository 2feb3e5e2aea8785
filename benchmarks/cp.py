"""Context parallelism measured (docs/context-parallel.md): messages, attention memory, step time, reach.

  python -m benchmarks.cp [--preset medium] [--cps 1,2,4] [--seq-len T] [--cap-mib 1024] [--steps 3] [--no-reach]
  python -m benchmarks.cp worker  (under mpirun: a short run, every rank's ring bytes and step times)

1. Bytes sent round the ring per step per rank, measured by the cp Comm's traffic count (the bytes
   of each message this rank sent), against the formula: per attention layer and micro-batch of B
   sequences, with S = 4 B (H / tp) (T / cp) D bytes (one tensor of a rank's keys), the forward sends
   keys and values K - 1 hops (2 S (K - 1)), the backward the keys and values again and their
   gradients K hops (2 S (K - 1) + 2 S K): 2 S (3K - 2), plus 2 S (K - 1) with --recompute.
2. Attention's saved activation bytes per layer and rank besides its output: the whole-sequence
   kernel's exponentials and reciprocal sums of every causal query block (capstone.model.kernels),
   measured on one rank from the arrays it saves; the ring's log-sum-exp, 4 B H (T / cp), measured
   on every rank of a ring under mpirun.
3. Step time at cp 2 against cp 1 on the same global tokens (one rank per core asked; the machine's
   other load is the reader's to state).
4. The longest sequence (doubling from 256) whose 2-step run stays under --cap-mib of peak RSS on
   every rank, at each cp, batch 1 per rank, found by launching real runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks import workers


def worker(argv: list[str]) -> int:
    from capstone import cli
    from capstone import run as runs
    from capstone import train
    from capstone.collective import launch
    from capstone.runtime import heap
    heap.keep_freed_memory()
    world = launch.world()
    settings = cli.parse_on_every_rank(argv, world.rank)
    run = runs.open_run(world, settings)
    sent, ms = [], []
    for s in range(1, settings.train.steps + 1):
        r = train.train_step(run, s)
        sent.append(r.traffic["cp_ring"].bytes if "cp_ring" in r.traffic else 0)
        ms.append(sum(r.ms.values()))
    saved = _ring_saved(run)
    every = world.allgather_json({"sent": sent, "ms": ms, "lse_bytes": saved})
    if world.rank == 0:
        m = run.mcfg
        print("RESULT " + json.dumps({"ranks": every, "B": run.batch_size, "T": m.seq_len, "H": m.n_heads,
                                      "D": m.d_model // m.n_heads, "L": m.n_layers, "tp": run.grid.tp.size,
                                      "cp": run.grid.cp_size, "accum": settings.train.grad_accum,
                                      "recompute": run.plan.recompute}), flush=True)
    return 0


def _ring_saved(run) -> int:
    """Bytes the ring's attention saves for its backward besides its output (the log-sum-exp), at the
    run's shapes, measured from the arrays (0 without cp)."""
    cp = run.model.cp
    if not hasattr(cp, "k"):
        return 0
    m, t = run.mcfg, run.mcfg.seq_len // cp.k
    h = m.n_heads // run.grid.tp.size
    qkv = np.random.default_rng(0).standard_normal((run.batch_size * t, 3 * h * (m.d_model // m.n_heads)))
    _, (lse, _) = cp.attention(qkv.astype(np.float32), t, h)
    return int(lse.nbytes)


def whole_saved(B: int, T: int, H: int, D: int) -> tuple[int, int]:
    """(measured, formula) bytes the whole-sequence kernel saves besides its output, one layer."""
    from capstone.model import kernels as K
    qkv = np.random.default_rng(0).standard_normal((B * T, 3 * H * D)).astype(np.float32)
    _, (blocks, _) = K._attention_fwd(qkv, T, H)
    measured = sum(e.nbytes + r.nbytes for _, _, e, r in blocks)
    formula = 4 * B * H * sum((e - s) * (e + 1) for s, e in K._query_blocks(T))
    return measured, formula


def ring_bytes(res: dict) -> float:
    """The formula of section 1: bytes one rank sends round the ring in a step without evaluation."""
    k = res["cp"]
    if k == 1:
        return 0.0            # no ring
    S = 4 * res["B"] * (res["H"] // res["tp"]) * (res["T"] // k) * res["D"]
    per = 2 * S * (3 * k - 2) + (2 * S * (k - 1) if res["recompute"] else 0)
    return per * res["L"] * res["accum"]


def _peak_rss(ranks: int, flags: list) -> float | None:
    """MiB of the largest peak RSS over the ranks of a 2-step run, None if it failed."""
    with tempfile.TemporaryDirectory(prefix="capstone-cp-reach-") as out:
        cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "capstone.train", "--out",
               os.path.join(out, "run"), *workers.QUIET_RUN, *map(str, flags)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workers.ROOT, timeout=3600)
        if res.returncode != 0:
            return None
        with open(os.path.join(out, "run", "summary.json")) as f:
            return json.load(f)["memory"]["max"]["peak_rss_bytes"] / 2**20


def reach(preset: str, cp: int, cap: float) -> tuple[int, list]:
    """The longest sequence (doubling from 256) whose run stays under `cap` MiB on every rank."""
    best, tried, T = 0, [], 256
    while True:
        rss = _peak_rss(cp, ["--preset", preset, "--cp", cp, "--seq-len", T, "--batch-size", 1, "--steps", 2,
                             "--eval-batches", 1, "--eval-batch-size", cp])
        tried.append((T, rss))
        if rss is None or rss > cap:
            return best, tried
        best, T = T, 2 * T


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.cp", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="medium", help="model size (default: medium)")
    p.add_argument("--cps", default="1,2,4", help="context-parallel sizes (default: 1,2,4)")
    p.add_argument("--seq-len", type=int, default=0, help="sections 1-3's sequence length (default: the preset's)")
    p.add_argument("--cap-mib", type=float, default=1024, help="per-rank peak RSS cap of section 4 (default: 1024)")
    p.add_argument("--steps", type=int, default=3, help="steps of the timed runs (default: 3)")
    p.add_argument("--no-reach", action="store_true", help="skip section 4 (the longest sequence: many launches)")
    a = p.parse_args(argv)
    cps = [int(k) for k in a.cps.split(",")]
    seq = ["--seq-len", a.seq_len] if a.seq_len else []
    runs = {k: workers.launch("benchmarks.cp", k, ["--preset", a.preset, "--cp", k, "--steps", a.steps,
                                                   "--batch-size", 4, *seq]) for k in cps}
    print("1. bytes sent round the ring per step per rank (step 2; formula 2 S (3K - 2) L m):")
    for k, res in runs.items():
        got = [r["sent"][1] for r in res["ranks"]]
        want = ring_bytes(res)
        worst = f"worst {max(abs(g - want) / want for g in got):.2%}" if want else f"largest {max(got)} B"
        print(f"   cp {k}: measured {min(got):,}..{max(got):,} B, formula {want:,.0f} B, {worst}")
    r1 = runs[cps[0]]
    print("2. attention's saved bytes per layer and rank, besides its output (B 4, T "
          f"{r1['T']}, H {r1['H']}):")
    measured, formula = whole_saved(4, r1["T"], r1["H"], r1["D"])
    print(f"   whole-sequence kernel: measured {measured:,} B, formula 4 B H sum (e - s)(e + 1) = {formula:,} B")
    for k, res in runs.items():
        if k > 1:
            got = [r["lse_bytes"] for r in res["ranks"]]
            print(f"   ring cp {k}: measured {max(got):,} B per rank, formula 4 B H T / cp = "
                  f"{4 * 4 * res['H'] * res['T'] // k:,} B")
    print("3. step time, the same global tokens (median of the steps after the first, ms):")
    for k, res in runs.items():
        ms = [statistics.median(r["ms"][1:]) for r in res["ranks"]]
        base = max(statistics.median(r["ms"][1:]) for r in runs[1]["ranks"]) if 1 in runs else None
        ratio = f" ({max(ms) / base:.2f} x cp 1)" if base and k > 1 else ""
        print(f"   cp {k} on {k} ranks: {max(ms):.0f} ms{ratio}")
    if not a.no_reach:
        print(f"4. the longest sequence under {a.cap_mib:.0f} MiB peak RSS per rank (batch 1 per rank):")
        for k in cps:
            best, tried = reach(a.preset, k, a.cap_mib)
            print(f"   cp {k}: {best} tokens (" + ", ".join(f"{t}: {'failed' if r is None else f'{r:.0f} MiB'}"
                                                     for t, r in tried) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
