"""Communication and memory accounting: pure functions, no MPI.

Bytes moved and achieved bandwidth of a collective as nccl-tests reports them (algbw, busbw), and
the ZeRO what-if: bytes per rank of parameters, gradients and optimizer state at stages 0-3.
`python -m capstone.observe.accounting` prints the what-if table and, with --run, a run's bandwidths.
"""

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass

from capstone.observe.runlog import read_run
from capstone.flags.pipe import fail, run_tool

# nccl-tests doc/PERFORMANCE.md, "Summary": busbw = algbw * factor(n), independent of the algorithm
# as long as it is built from point-to-point transfers.
# reduce_scatterv, allgatherv: with per-rank counts (ZeRO-2's groups, ZeRO-3's gathered groups): S is what they sum
# to; alltoallv: --deterministic at ZeRO-2/3, a group's pieces (S: what one rank sends); p2p: a pipeline's messages
# between neighbouring stages (S: their bytes).
BUS_FACTORS = {"allreduce": lambda n: 2 * (n - 1) / n, **dict.fromkeys(("broadcast", "p2p", "reduce"), lambda n: 1.0),
               **dict.fromkeys(("reduce_scatter", "allgather", "alltoall", "reduce_scatterv", "allgatherv",
                                "alltoallv"), lambda n: (n - 1) / n)}
PER_RANK_COUNT = ("reduce_scatter", "allgather", "alltoall")  # ops whose buffer is n equal per-rank blocks


@dataclass(frozen=True)
class Collective:
    """One collective call, in nccl-tests' terms (doc/PERFORMANCE.md):

    - S (`size_bytes`) is the total data size: `count * itemsize`, where `count` is the element count
      of the whole buffer. For allreduce/broadcast/reduce that is the buffer every rank passes; for
      reduce-scatter and allgather it is the full (gathered / unscattered) buffer, i.e.
      n * per-rank count * itemsize ("recvcount*sizeof(datatype)*n" and "sendcount*...*n").
    - algbw = S / t.
    - busbw = algbw * 2(n-1)/n for allreduce, algbw * (n-1)/n for reduce-scatter, allgather and
      alltoall, algbw for broadcast and reduce: the per-link rate that can be compared with the
      hardware peak, whatever n is.
    - A ring sends busbw * t bytes out of each rank: 2(n-1)/n * S for allreduce (reduce-scatter then
      allgather, 2(n-1) chunks of S/n), (n-1)/n * S for reduce-scatter and allgather, S for broadcast
      and reduce (the root's link is the bottleneck).
    Bandwidths are in bytes per second (nccl-tests prints GB/s = 1e9 bytes/s).
    """

    name: str        # a key of BUS_FACTORS
    count: int       # elements of the whole buffer (see above)
    itemsize: int    # bytes per element (4 for float32)
    world: int       # ranks n
    seconds: float   # measured time t

    def __post_init__(self):
        if self.name not in BUS_FACTORS:
            raise ValueError(f"unknown collective {self.name!r}; one of {sorted(BUS_FACTORS)}")
        if self.world < 1 or self.count < 0 or self.itemsize < 1:
            raise ValueError(f"need world >= 1, count >= 0, itemsize >= 1; got {self}")
        if self.name in PER_RANK_COUNT and self.count % self.world:
            raise ValueError(f"{self.name}: count {self.count} is not n={self.world} equal blocks (pad the buffer)")

    @classmethod
    def per_rank(cls, name: str, per_rank_count: int, itemsize: int, world: int, seconds: float) -> "Collective":
        """From the per-rank count MPI/NCCL take for reduce-scatter (recvcount) and allgather (sendcount)."""
        return cls(name, per_rank_count * world, itemsize, world, seconds)

    @property
    def size_bytes(self) -> int:
        """S, the total data size in bytes."""
        return self.count * self.itemsize

    @property
    def bus_factor(self) -> float:
        return BUS_FACTORS[self.name](self.world)

    @property
    def algbw(self) -> float:
        """S / t in bytes/s (NaN when no time was measured)."""
        return self.size_bytes / self.seconds if self.seconds > 0 else float("nan")

    @property
    def busbw(self) -> float:
        """algbw times the collective's bus factor, bytes/s."""
        return self.algbw * self.bus_factor

    @property
    def ring_bytes_sent_per_rank(self) -> float:
        """Bytes each rank sends with a ring algorithm (= busbw * t)."""
        return self.size_bytes * self.bus_factor


def step_collectives(row: dict) -> list[Collective]:
    """The collectives of one step, from a metrics.jsonl row's "comm" (those that took any time)."""
    return [Collective(e["op"], e["bytes"], 1, e["ranks"], e["ms"] / 1e3)
            for e in (row.get("comm") or {}).values() if e.get("ms", 0) > 0]


def format_collectives(records: list[Collective], kinds: list[str] | None = None) -> str:
    """A table of collectives, each row named by its kind (a run's: reduce_scatter, allreduce_stats,
    ...) when `kinds` is given, else by its op."""
    columns = [("collective", "<18"), ("op", "<15"), ("ranks", ">5"), ("S bytes", ">10"), ("time ms", ">9.3f"),
               ("algbw GB/s", ">11.3f"), ("busbw GB/s", ">11.3f"), ("sent/rank B", ">12.0f")]
    return table(columns, [(kind, c.name, c.world, c.size_bytes, 1e3 * c.seconds, c.algbw / 1e9, c.busbw / 1e9,
                            c.ring_bytes_sent_per_rank) for c, kind in zip(records, kinds or [c.name for c in records])])


def table(columns: list[tuple[str, str]], rows: list) -> str:
    """A text table, one space between columns: the titles of `columns` ((title, format spec of its
    values)), each as wide as its values, then each row of `rows` (its values in column order; a row
    shorter than `columns` leaves the last columns out)."""
    titles = " ".join(format(title, spec.split(".")[0]) for title, spec in columns)
    return "\n".join([titles] + [" ".join(format(v, spec) for v, (_, spec) in zip(row, columns)) for row in rows])


# ---- the collectives of one training step (metrics.jsonl "comm", summary.json "comm") ----------

def step_comm(traffic: dict) -> dict:
    """The "comm" dict of a step row from the step's traffic (capstone.collective.comm.Traffic by kind):
    per kind of collective its op, S bytes summed over its calls, the bytes a ring sends per rank,
    the milliseconds spent waiting for it, the bandwidths, its calls and the ranks of its group."""
    return {kind: {**comm_entry(Collective(t.op, t.bytes, 1, t.ranks, t.seconds)), "calls": t.calls, "ranks": t.ranks,
                   **({"hidden_ms": 1e3 * t.hidden} if t.hidden else {})} for kind, t in traffic.items()}


def comm_entry(c: Collective) -> dict:
    """A collective as a metrics/summary record: S bytes, bytes a ring sends per rank, ms, GB/s (1e9)."""
    return {"op": c.name, "bytes": c.size_bytes, "sent_bytes_per_rank": c.ring_bytes_sent_per_rank,
            "ms": 1e3 * c.seconds, "algbw_GBps": c.algbw / 1e9, "busbw_GBps": c.busbw / 1e9}


def comm_summary(rows: list[dict], skip_first: bool = True) -> dict:
    """Per kind of collective over step rows: the median time (over the steps after the first of the
    list, which pays warm-up, when there are more and `skip_first`), its bandwidths at the bytes of
    the last step it ran in, the steps it ran in."""
    rows = [r for r in rows if isinstance(r.get("comm"), dict)]
    timed = rows[1:] if skip_first and len(rows) > 1 else rows
    out = {}
    for name in dict.fromkeys(k for r in rows for k in r["comm"]):
        last = [r["comm"][name] for r in rows if name in r["comm"]][-1]
        if times := [r["comm"][name]["ms"] for r in timed if name in r["comm"]]:
            entry = comm_entry(Collective(last["op"], last["bytes"], 1, last["ranks"], statistics.median(times) / 1e3))
            out[name] = {"median_ms": entry.pop("ms"), **entry, "steps": sum(name in r["comm"] for r in rows),
                         "timed_steps": len(times), "calls": last["calls"], "ranks": last["ranks"]}
            # a prefetched or progressed collective: the time it ran behind compute
            if any(hidden := [r["comm"][name].get("hidden_ms", 0.0) for r in timed if name in r["comm"]]):
                out[name]["median_hidden_ms"] = statistics.median(hidden)
    return out


def format_comm_summary(comm: dict) -> str:
    """The table: median ms is the time the step waited (exposed); hidden ms, where a collective ran
    behind compute (ZeRO-2/3's progressed reductions and prefetched gathers), the time it overlapped."""
    hidden = any("median_hidden_ms" in e for e in comm.values())
    columns = [("collective", "<16"), ("op", "<18"), ("bytes", ">10"), ("median ms", ">9.3f"), ("algbw GB/s", ">10.4g"),
               ("busbw GB/s", ">10.4g"), ("steps", ">6")] + [("hidden ms", ">9.3f")] * hidden
    # op "x N": a step made N calls, their bytes and times summed
    return table(columns, [(name, e["op"] + (f" x{e['calls']}" if e.get("calls", 1) > 1 else ""), e["bytes"],
                            e["median_ms"], e["algbw_GBps"], e["busbw_GBps"], e["steps"],
                            e.get("median_hidden_ms", 0.0)) for name, e in comm.items()])


# ---- ZeRO what-if ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each kind of state."""

    name: str
    param: int      # the parameters the model computes with
    grad: int       # their gradients
    optimizer: int  # K: everything Adam keeps (the fp32 master copy, m and v)


# This project: fp32 parameters and gradients; Adam keeps an fp32 master copy plus m and v (12 bytes).
FP32 = Precision("fp32", 4, 4, 12)
# The ZeRO paper (Rajbhandari et al. 2020, section 3.1): mixed-precision Adam, fp16 parameters and
# gradients (2 + 2 bytes) and K = 12 bytes of fp32 master parameters, momentum and variance.
MIXED = Precision("mixed", 2, 2, 12)
# --precision bf16: bfloat16 working parameters, a float32 gradient (micro-batches accumulate in float32 and the
# exchange stays one per step: docs/precision.md), the fp32 master, m and v
BF16 = Precision("bf16", 2, 4, 12)
PRECISIONS = {p.name: p for p in (FP32, MIXED, BF16)}
STAGES = {0: "nothing (DDP)", 1: "optimizer state", 2: "optimizer state, grads", 3: "optimizer, grads, params"}


@dataclass(frozen=True)
class ZeroRow:
    """Bytes held per rank at one ZeRO stage."""

    stage: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def zero_row(stage: int, n_params: int, world: int, precision: Precision = FP32) -> ZeroRow:
    """Stage s shards (1) the optimizer state, (2) also the gradients, (3) also the parameters over
    `world` ranks; a sharded rank holds ceil(n_params / world) elements (the project's padded shard)."""
    if stage not in STAGES or n_params < 0 or world < 1:
        raise ValueError(f"need stage in 0..3, n_params >= 0, world >= 1; got {stage}, {n_params}, {world}")
    held = lambda sharded: -(-n_params // world) if sharded else n_params  # noqa: E731
    return ZeroRow(stage, precision.param * held(stage >= 3), precision.grad * held(stage >= 2),
                   precision.optimizer * held(stage >= 1))


def zero_table(n_params: int, world: int, precision: Precision = FP32) -> list[ZeroRow]:
    """Stages 0..3 for a model of `n_params` parameters (or the padded buffer length) on `world` ranks."""
    return [zero_row(s, n_params, world, precision) for s in STAGES]


def format_zero_table(rows: list[ZeroRow], n_params: int, world: int, precision: Precision = FP32) -> str:
    p = precision
    columns = [("stage", "<5"), ("sharded", "<26")] + [(k, ">12") for k in ("params", "grads", "optimizer", "total")]
    values = [(r.stage, STAGES[r.stage], r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.total_bytes) for r in rows]
    return (f"ZeRO what-if, {p.name} ({p.param}+{p.grad}+{p.optimizer} bytes per parameter): P={n_params} "
            f"parameters on N={world} ranks, bytes per rank\n" + table(columns, values))


def what_if(n_params: int, padded: int, world: int, memory: list[dict], precision: Precision = FP32) -> dict:
    """summary.json's "zero_what_if": the table for P = `padded` (the live flat buffer) on `world`
    ranks, and beside it what the run measured per rank at its own stage (max over ranks) with that
    stage's formula (capstone.observe.memory): the buffers of the gradient reduction (`reduce_bytes`)
    and of the ZeRO-3 gathers (`gathered_bytes`) are counted apart from the table's three terms."""
    p = precision
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes", "reduce_bytes", "gathered_bytes")
    measured = {k: max(m.get(k, 0) for m in memory) for k in keys} if memory else {}
    formula = {k: max(m["formula"].get(k, 0) for m in memory) for k in keys} if memory and "formula" in memory[0] else {}
    stage = memory[0].get("stage", 1) if memory else 1
    return {"precision": p.name, "bytes_per_param": {"params": p.param, "grads": p.grad, "optimizer": p.optimizer},
            "n_params": n_params, "P": padded, "world": world, "measured": {"stage": stage, **measured},
            "formula": formula, "stages": [{"stage": r.stage, "sharded": STAGES[r.stage], **asdict(r),
                                            "total_bytes": r.total_bytes} for r in zero_table(padded, world, p)]}


def format_what_if(w: dict) -> str:
    """The what-if table, and under it the running stage: measured (max over ranks) and its formula."""
    precision = PRECISIONS[w["precision"]]
    text = format_zero_table(zero_table(w["P"], w["world"], precision), w["P"], w["world"], precision)
    stage = w["measured"]["stage"]
    for label, m in (("measured (max over ranks)", w["measured"]), (f"formula of stage {stage}", w.get("formula"))):
        if m and "params_bytes" in m:
            total = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
            text += (f"\n{stage:<5} {label:<26} {m['params_bytes']:>12} {m['grads_bytes']:>12} "
                     f"{m['optimizer_bytes']:>12} {total:>12}  (+ reduction {m['reduce_bytes']}"
                     + (f", gathered {m['gathered_bytes']}" if m.get("gathered_bytes") else "") + ")")
    return text


# ---- command line ------------------------------------------------------------------------------
def run_bandwidths(run_dir: str) -> tuple[dict, dict[str, Collective]]:
    """(summary, kind -> its collective with the median time over steps 2..) of a finished run."""
    run = read_run(run_dir)
    if not run.summary:
        raise FileNotFoundError(f"{run_dir}/summary.json not found: the run has not finished")
    timed = comm_summary([row for row in run.rows if row["step"] >= 2], skip_first=False)  # step 1 pays warm-up
    return run.summary, {kind: Collective(e["op"], e["bytes"], 1, e["ranks"], e["median_ms"] / 1e3)
                         for kind, e in timed.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m capstone.observe.accounting", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="ZeRO what-if memory table and, for a finished run, the achieved "
                                            "bandwidth of its collectives (nccl-tests definitions).")
    p.add_argument("--params", type=int, default=30144, help="parameters P (or the padded buffer length)")
    p.add_argument("--world", type=int, default=4, help="ranks N")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                   help="fp32: this project (4+4+12 bytes); mixed: the ZeRO paper (2+2+12)")
    p.add_argument("--run", default=None, help="a finished run dir: print its bandwidths; its padded size and world replace --params/--world")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.params < 0 or args.world < 1:
        return fail(f"--params {args.params}: a parameter count is 0 or more; pass e.g. --params 30144."
                    if args.params < 0 else f"--world {args.world}: a run has 1 rank or more; pass e.g. --world 4.")
    n_params, world = args.params, args.world
    if args.run:
        try:
            summary, records = run_bandwidths(args.run)
        except (FileNotFoundError, KeyError) as exc:
            return fail(exc)
        n_params, world = summary["padded"], summary["world_size"]
        print(f"{args.run}: median over steps 2.. of rank 0's timings\n"
              f"{format_collectives(list(records.values()), list(records))}\n")
    precision = PRECISIONS[args.precision]
    print(format_zero_table(zero_table(n_params, world, precision), n_params, world, precision))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
