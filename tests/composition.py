"""The composition matrix (docs/composition.md): every mode of the product against the others.

A row is one value per axis. `refusal(row)` is the product's own rule for the combinations it does
not run (they must exit 2 at start with that reason); every other row must train, pass its
invariants, and match the 1-rank run of the same global batch and injections step by step.
`pairs(seed)` is a seeded all-pairs selection (every pair of values of two axes that the product
runs together in at least one row it runs; each kind of refusal in one row refused for it alone),
`full()` every row the product runs and one row per reason it refuses, `product()` every row. Not a
test module: tests/test_composition.py runs the rows; scripts/composition-matrix runs them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from dataclasses import dataclass

GLOBAL = 96          # sequences per step: divisible by every data-parallel size x accumulation
STEPS = 8
CP_SEQ_LEN = 64      # the rows with context parallelism and their references (docs/context-parallel.md)
STOP_AT = 4          # the stopped rows stop here and resume on another grid
NAN_STEP, SPIKE_STEP = 3, 6
DROPOUT = 0.1
# the learning rate of the rows with a tied head, dropout or cp's longer sequences (and of their 1-rank
# references): at the
# reference's 1e-2 these 8-step runs amplify the float32 rounding of another summation order past 1e-5
# by themselves (one rank, 4 micro-batches against 1: tied and dropout 1.1e-5 apart at step 6, dropout
# alone 1.5e-5, tied alone 6.4e-6 at step 8); at 3e-3 at most 1.9e-6, while a mask or a tied gradient
# gone wrong is off by far more (cp at seq len 64: an 8-rank row 2.3e-5 from its reference at 1e-2)
OPTION_LR = 3e-3
# the reference model with 4 blocks (room for 4 pipeline stages) and buckets small enough for several
# of them, healthy settings
COMMON = ("--steps", STEPS, "--global-batch", GLOBAL, "--ckpt-every", STOP_AT, "--bucket-mb", "0.02", "--n-layers", 4,
          "--quiet")

AXES = {
    "world": (1, 2, 3, 4, 8),
    "tp": (1, 2),
    "accum": (1, 2, 4),
    "overlap": (True, False),
    "det": (False, True),
    "inject": ("clean", "nan", "spike"),
    "resume": (False, True),
    "zero": (0, 1, 2, 3),
    "recompute": (False, True),
    "pp": ("off", "2:1f1b", "2:afab", "2:zb-h1", "4:1f1b", "4:afab", "4:zb-h1"),   # pipeline stages, schedule
    "reshard": ("micro-batch", "step"),                       # ZeRO-2/3: gather and reduce per micro-batch or step
    "undo": (True, False),    # the guard's undo copy (False: --no-guard-undo)
    "tie": (False, True),     # --tie-embeddings: the LM head is wte
    "dropout": (False, True), # --dropout DROPOUT (the mask a pure function of the sample's indices)
    "ckpt_async": (True, False),   # checkpoints written in the background (False: --no-ckpt-async)
    "cp": (1, 2, 4),          # context parallelism: each sequence split over cp ranks (at --seq-len CP_SEQ_LEN)
    "bias": (True, False),    # False: --no-bias (nanoGPT's bias=False)
    "precision": ("fp32", "bf16"),   # --precision bf16: bfloat16 working parameters, activations and messages
}


@dataclass(frozen=True)
class Row:
    world: int
    tp: int
    accum: int
    overlap: bool
    det: bool
    inject: str
    resume: bool
    zero: int = 1
    recompute: bool = False
    pp: str = "off"
    reshard: str = "micro-batch"
    undo: bool = True
    tie: bool = False
    dropout: bool = False
    ckpt_async: bool = True
    cp: int = 1
    bias: bool = True
    precision: str = "fp32"
    long: bool = False     # at --seq-len CP_SEQ_LEN without cp (a cp row's reference, or its resume at cp 1)

    @property
    def seq_len(self) -> int | None:
        return CP_SEQ_LEN if self.cp > 1 or self.long else None

    @property
    def stages(self) -> int:
        return 1 if self.pp == "off" else int(self.pp.split(":")[0])

    @property
    def blocks(self) -> int:
        """Micro-batches per step over the data-parallel group: with GLOBAL, the per-rank micro-batch."""
        return self.world // (self.tp * self.stages * self.cp) * self.accum

    @property
    def name(self) -> str:
        return (f"n{self.world}-tp{self.tp}-acc{self.accum}-{'overlap' if self.overlap else 'no-overlap'}-"
                f"{'det' if self.det else 'default'}-{self.inject}-zero{self.zero}"
                + ("-recompute" if self.recompute else "") + ("" if self.pp == "off" else f"-pp{self.pp.replace(':', '-')}")
                + ("" if self.reshard == "micro-batch" else f"-reshard-{self.reshard}")
                + ("" if self.undo else "-no-undo") + ("-tie" if self.tie else "") + ("-dropout" if self.dropout else "")
                + ("" if self.ckpt_async else "-sync-ckpt") + ("" if self.cp == 1 else f"-cp{self.cp}") + ("" if self.bias else "-no-bias")
                + ("" if self.precision == "fp32" else f"-{self.precision}")
                + (f"-stop{STOP_AT}-resume-{self.resumed_on()}" if self.resume else ""))

    def flags(self) -> list:
        """The training flags of this row (without --out and --resume)."""
        flags = [*COMMON, "--tp", self.tp, "--grad-accum", self.accum]
        flags += [] if self.overlap else ["--no-overlap"]
        flags += ["--deterministic"] if self.det else []
        flags += ["--zero-stage", self.zero] + (["--recompute"] if self.recompute else [])
        flags += [] if self.reshard == "micro-batch" else ["--reshard", self.reshard]
        flags += [] if self.undo else ["--no-guard-undo"]
        flags += ["--tie-embeddings"] if self.tie else []
        flags += [] if self.bias else ["--no-bias"]
        flags += ["--precision", self.precision]
        flags += ["--dropout", DROPOUT] if self.dropout else []
        flags += ["--lr", OPTION_LR] if self.tie or self.dropout or self.seq_len else []
        flags += [] if self.ckpt_async else ["--no-ckpt-async"]
        flags += [] if self.seq_len is None else ["--cp", self.cp, "--seq-len", self.seq_len]
        flags += ["--pp", 1] if self.pp == "off" else ["--pp", self.stages, "--pp-schedule", self.pp.split(":")[1]]
        flags += {"clean": [], "nan": ["--inject-nan", NAN_STEP], "spike": ["--inject-lr-spike", f"{SPIKE_STEP}:1000"]}[
            self.inject]
        return [str(f) for f in flags]

    def resumed_on(self) -> str:
        """The other grid a stopped row resumes on: another world size (with the same micro-batch,
        so that a deterministic row stays bit-identical), tensor parallelism kept where it fits,
        and another ZeRO stage (0 after 3, 1 after 2; 3 after 0 or 1 where the row's modes allow it, else
        1 after 0 and 0 after 1)."""
        again = self.resumed()
        return (f"n{again.world}-tp{again.tp}-acc{again.accum}-zero{again.zero}"
                + ("" if again.pp == "off" else f"-pp{again.stages}") + ("" if again.cp == 1 else f"-cp{again.cp}"))

    def resumed(self) -> "Row":
        """The row of the resumed launch (its flags; `resume` False)."""
        world, accum = other_layout(self.world, self.accum)
        tp = self.tp if world % self.tp == 0 else 1
        pp = self.pp if world % (tp * self.stages) == 0 else "off"
        cp = self.cp if world % (tp * (1 if pp == "off" else self.stages) * self.cp) == 0 else 1
        dp = world // (tp * (1 if pp == "off" else self.stages) * cp)
        accum = self.blocks // dp if self.blocks % dp == 0 else accum    # the same per-rank micro-batch
        zero = {3: 0, 2: 1}.get(self.zero, 1 - self.zero if self.det or not self.overlap or pp != "off" else 3)
        return dataclasses.replace(self, world=world, tp=tp, accum=accum, zero=zero, pp=pp, resume=False,
                                   reshard="micro-batch" if zero < 2 else self.reshard, cp=cp,
                                   long=self.seq_len is not None)


def det_partner(row: Row) -> Row | None:
    """Another data-parallel layout of a deterministic row, which must give the same bits: the same
    tp, pp and per-rank micro-batch (data-parallel size x accumulation kept), the other bucketing
    and recomputation; None if no other world size of the axis fits."""
    parts = row.tp * row.stages * row.cp
    dp, blocks = row.world // parts, row.world // parts * row.accum
    for other in (2, 4, 1, 3, 8):
        if other != dp and blocks % other == 0 and other * parts in AXES["world"]:
            overlap = not row.overlap
            return Row(other * parts, row.tp, blocks // other, overlap, True, row.inject, False, row.zero,
                       not row.recompute, row.pp, row.reshard, row.undo, row.tie, row.dropout, row.ckpt_async,
                       row.cp, row.bias, row.precision, row.long)
    return None


def other_layout(world: int, accum: int) -> tuple[int, int]:
    """Another (world, accum) with the same product (the same per-rank micro-batch), else another world."""
    for w in (2, 4, 1, 3):
        if w != world and (world * accum) % w == 0:
            return w, world * accum // w
    return 2, accum


def reasons(row: Row) -> list[str]:
    """Why the product refuses this row at start (exit 2), in the order it checks; [] if it runs it."""
    found, k = [], row.stages
    if row.world % (row.tp * k):
        found.append(f"--tp {row.tp} x --pp {k} = {row.tp * k} does not divide the {row.world} ranks")
    elif row.world // (row.tp * k) % row.cp:
        found.append(f"--cp {row.cp} does not divide the {row.world // (row.tp * k)} ranks per tensor- and pipeline-")
    if row.reshard != "micro-batch" and row.zero < 2:
        found.append(f"--reshard {row.reshard} is about ZeRO-2/3's sharded gradient and parameters")
    if not row.overlap and row.zero > 1 and row.reshard == "micro-batch" and not row.det:
        found.append(f"--no-overlap is not supported with --zero-stage {row.zero}")
    return found


def refusal(row: Row) -> str | None:
    """The message the product gives for this row (its first reason), None if it runs it."""
    return (reasons(row) or [None])[0]


def product() -> list[Row]:
    return [Row(*values) for values in itertools.product(*AXES.values())]


def _pairs_of(row: Row) -> set:
    items = list(vars(row).items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def full() -> list[Row]:
    """Every row the product runs, and for each reason it refuses rows for, one row refused for it alone."""
    everything, shown, rows = product(), set(), []
    for r in everything:
        found = reasons(r)
        if not found or len(found) == 1 and found[0] not in shown:
            rows.append(r)
            shown.update(found)
    return rows


def kind(reason: str) -> str:
    """A refusal's rule, whatever the numbers ("--tp N x --pp N = N does not divide the N ranks")."""
    return re.sub(r"\d+", "N", reason)


# the axes `reasons` reads: every value of the other axes runs beside every combination of these that runs
RULED = ("world", "tp", "det", "zero", "overlap", "pp", "reshard", "cp")


def _runnable_pairs() -> tuple[set, set]:
    """(every pair of values the product runs together, the refusal rules), without listing the
    product's rows: only the RULED axes are enumerated (a few thousand combinations)."""
    base = {a: v[0] for a, v in AXES.items()}
    fields = list(vars(Row(**base)))
    ruled = [a for a in fields if a in RULED]
    seen, left, rules = {a: set() for a in fields}, set(), set()
    for values in itertools.product(*(AXES[a] for a in ruled)):
        row = Row(**{**base, **dict(zip(ruled, values))})
        found = reasons(row)
        rules |= {kind(x) for x in found}
        if not found:
            items = [(a, getattr(row, a)) for a in ruled]
            left |= set(itertools.combinations(items, 2))
            for a, v in items:
                seen[a].add(v)
    for a in fields:
        if a not in RULED:
            seen[a] = set(AXES.get(a, (getattr(Row(**base), a),)))
    for a, b in itertools.combinations(fields, 2):
        if a not in RULED or b not in RULED:
            left |= {((a, u), (b, v)) for u in seen[a] for v in seen[b]}
    return left, rules


def pairs(seed: int = 25) -> list[Row]:
    """A seeded greedy all-pairs selection: rows are added, best first, until every pair of values
    the product runs together is in a row it runs, and every rule by which it refuses a row is
    shown by a row refused for that reason alone."""
    left, rules = _runnable_pairs()
    left |= rules
    rng, chosen = random.Random(seed), []

    def covers(r):   # a refused row covers its rule, if it is refused for that one reason
        found = reasons(r)
        return _pairs_of(r) & left if not found else {kind(found[0])} & left if len(found) == 1 else set()
    while left:
        for size in (300, 3000, 30000):   # a larger sample when the few items left are rare
            best = max((Row(**{a: rng.choice(v) for a, v in AXES.items()}) for _ in range(size)),
                       key=lambda r: len(covers(r)))
            if covers(best):
                break
        else:
            best = next(r for r in (Row(*v) for v in itertools.product(*AXES.values())) if covers(r))
        chosen.append(best)
        left -= covers(best)
    return chosen


NAME = re.compile(r"n(\d+)-tp(\d+)-acc(\d+)-(overlap|no-overlap)-(det|default)-(clean|nan|spike)-zero(\d)(-recompute)?"
                  r"(?:-pp(\d)-(1f1b|afab|zb-h1))?(?:-reshard-(step))?(-no-undo)?(-tie)?(-dropout)?(-sync-ckpt)?(?:-cp(\d))?(-no-bias)?"
                  r"(-bf16)?(-stop\d+-resume-.*)?")


def named(names) -> list[Row]:
    """The rows of these names (`Row.name`), e.g. those a mutant's test names; ValueError for a name
    that is no row of the product."""
    rows = []
    for name in names:
        m = NAME.fullmatch(name)
        if not m:
            raise ValueError(f"{name!r} is not the name of a row of the composition matrix")
        w, tp, acc, ov, det, inj, zero, rec, k, sched, resh, noundo, tie, drop, sync, cp, nobias, bf16, res = m.groups()
        row = Row(int(w), int(tp), int(acc), ov == "overlap", det == "det", inj, res is not None, int(zero),
                  rec is not None, "off" if k is None else f"{k}:{sched}", resh or "micro-batch", noundo is None,
                  tie is not None, drop is not None, sync is None, int(cp or 1), nobias is None,
                  "fp32" if bf16 is None else "bf16")
        if row.name != name or any(getattr(row, a) not in v for a, v in AXES.items()):
            raise ValueError(f"{name!r} is not the name of a row of the composition matrix")
        rows.append(row)
    return rows


if __name__ == "__main__":   # python tests/composition.py [--full]: the rows, and the refusals with their reasons
    import sys
    rows = full() if "--full" in sys.argv else pairs()
    print(f"{len(rows)} rows ({'every row run, one per refusal' if '--full' in sys.argv else 'seeded all-pairs, seed 25'}):")
    for r in rows:
        print(f"  {r.name:<84} {refusal(r) or 'runs: matches the 1-rank run'}")
    refused = [r for r in product() if reasons(r)]
    print(f"\nthe product refuses {len(refused)} of {len(product())} rows, for these reasons:")
    for reason in sorted({x for r in refused for x in reasons(r)}):
        print(f"  {reason}: {sum(reason in reasons(r) for r in refused)} rows")
