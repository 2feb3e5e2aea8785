"""The run's plan: how one run is laid out on its ranks and in memory, as one frozen object.

The flags that lay a run out (tensor, pipeline and context parallelism; the ZeRO stage and how it
reshards; recompute; the gradient exchange's overlap and bucket size; the guard's undo copy; the
asynchronous checkpoint's snapshot; the pipeline's stages and schedule; the fixed-order sums of
--deterministic) become one `Plan`, made once on the world the run has (`Plan.make`), under a
checkpoint's kept modes on --resume. Everyone else reads the plan: the grid
(capstone.parallel.grid), the modes (capstone.modes), the preflight, the memory table and the
checkpoints' record of the modes (`Plan.kept`, capstone.checkpoint.kept).

Every refusal of a layout is here, each said once: a flag's own value (`CHECKS`, reported with
the other bad flags when the command line is parsed) and a combination that does not fit the model
or the world (`Plan.make`, exit 2 with the reason).

"dp" has one meaning: `replicas`, the data-parallel replicas that read different samples,
world / (tp x pp x cp). The ranks that hold the same parameters and shard their ZeRO state are a
stage's tensor-parallel slice over the replicas and the context-parallel ring: `zero_group`, replicas x cp.

On --resume a layout flag not given takes the checkpoint's kept mode. The checkpoint is canonical
(any grid resumes it), so a kept tp or pp that does not fit the ranks of this launch falls back to
1 (tp kept before pp when only one fits), and a kept mode about another (the schedule and stages
of a pipeline, the reshard policy of ZeRO-2/3) goes back to its default where that one no longer
applies; `make` says why, for the changed-settings line.
"""

import dataclasses
import math

from capstone.config import ConfigError, problems_error

# the layout flags, with their defaults (every one has no argparse default, so a resume tells given from not)
DEFAULTS = {"tp": 1, "pp": 1, "cp": 1, "zero_stage": 1, "reshard": "micro-batch", "recompute": False, "overlap": True,
            "bucket_mb": 1.0, "guard_undo": True, "ckpt_async": True, "pp_schedule": None, "pp_layers": None,
            "det_split": None, "precision": "fp32"}
# those a checkpoint keeps (its `modes`); not kept: the bucket size and overlap (tuning of the exchange's
# messages), cp (any --cp resumes: the samples are the same), and the checkpoint's own write mode
KEPT = ("zero_stage", "reshard", "recompute", "tp", "pp", "pp_schedule", "pp_layers", "guard_undo", "det_split",
        "precision")
# the layout flags' own checks of their parsed values (capstone.flags.usage.checked: one sentence per bad flag)
CHECKS = (("tp", lambda v: v >= 1, "must be >= 1 (1: no tensor parallelism)"),
          ("pp", lambda v: v >= 1, "must be >= 1 (1: no pipeline)"),
          ("cp", lambda v: v >= 1, "must be >= 1 (1: no context parallelism)"),
          ("bucket_mb", lambda v: v > 0, "must be > 0 MB (default 1.0; --no-overlap for one reduction)"),
          ("det_split", lambda v: v >= 1 and v & (v - 1) == 0, "must be a power of two (--deterministic's pieces and "
           "chunks: docs/deterministic.md)"))


@dataclasses.dataclass(frozen=True)
class Zero:
    """A ZeRO stage: what it shards over the zero group, and so what each rank keeps and reduces."""

    stage: int

    @property
    def shards_optimizer(self) -> bool:   # stage 0 (DDP) keeps the whole state and allreduces the gradient
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:       # each group's gradient reduce-scattered into the shard as it is made
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:      # the parameters a shard too, gathered group by group
        return self.stage >= 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """One run's layout (see the module). Made by `make`, never changed."""

    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: Zero = Zero(1)
    reshard: str = "micro-batch"      # ZeRO-2/3: gather and reduce per micro-batch, or once per step
    recompute: bool = False           # activation checkpointing
    overlap: bool = True              # the gradient reduced in buckets during the backward pass
    bucket_mb: float = 1.0
    deterministic: bool = False       # fixed-order sums (capstone.parallel.deterministic)
    guard_undo: bool = True           # the guard keeps the optimizer state from before each update
    ckpt_async: bool = True           # a snapshot buffer for the background checkpoint write
    pp_schedule: str | None = None    # the pipeline's order of forwards and backwards (None: 1f1b)
    pp_layers: tuple[int, ...] | None = None   # blocks per pipeline stage (None: balanced)
    det_split: int = 4                # --deterministic's pieces and chunks (capstone.model.exact)
    precision: str = "fp32"           # bf16: bfloat16 working parameters, activations, messages (model.precision)
    stages: tuple = (None,)           # each pipeline stage's parameter groups ((None,): one stage, the whole model)

    @property
    def replicas(self) -> int:
        """The data-parallel replicas: ranks that read different samples (the one definition of dp)."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def zero_group(self) -> int:
        """The ranks that hold the same parameters and shard their ZeRO state: replicas x cp."""
        return self.replicas * self.cp

    @property
    def schedule(self) -> str:
        return self.pp_schedule or "1f1b"

    @property
    def post_validates(self) -> bool:
        """A zero-bubble schedule takes the update before the step's checks (capstone.parallel.postvalidation),
        where the optimizer updates the reduced shard (not ZeRO-0's fixed-order sums, allgathered after them)."""
        return self.pp > 1 and self.schedule == "zb-h1" and (self.zero.shards_optimizer or not self.deterministic)

    @property
    def whole_grad(self) -> bool:
        """ZeRO-2/3 with --reshard step: the whole gradient accumulates through the step (not with the
        fixed-order exchange, which exchanges each micro-batch's as it is made)."""
        return self.zero.shards_grads and self.reshard == "step" and not self.deterministic

    def bucket_floats(self, padded: int) -> int:
        """The gradient exchange's bucket, in floats (--no-overlap: the whole buffer at once)."""
        return int(self.bucket_mb * 2**20) // 4 if self.overlap else padded

    def kept(self) -> dict:
        """The modes a checkpoint records (JSON-able)."""
        values = {**dataclasses.asdict(self), "zero_stage": self.zero.stage}
        return {name: list(values[name]) if isinstance(values[name], tuple) else values[name] for name in KEPT}

    def check_placement(self, hosts: list[str]) -> None:
        """ConfigError if the launcher put a tensor-parallel group's ranks (tp consecutive ranks) on more
        than one host: they exchange activations in every layer (capstone.parallel.placement)."""
        for first in range(0, len(hosts), self.tp) if self.tp > 1 else ():
            if len(on := sorted(set(hosts[first:first + self.tp]))) > 1:
                d, rest = divmod(first, self.pp * self.cp * self.tp)
                ranks = ", ".join(f"rank {r} on {hosts[r]}" for r in range(first, first + self.tp))
                raise ConfigError(
                    f"--tp {self.tp}: the tensor-parallel group of ranks {first}-{first + self.tp - 1} (dp {d}, pp "
                    f"{rest // self.tp}) is split over {len(on)} hosts ({ranks}); its ranks exchange activations in "
                    f"every layer, so they must share a node. The launcher placed consecutive ranks on different "
                    f"nodes: launch them in blocks (srun --distribution=block, Slurm's default; mpirun --map-by "
                    f"slot, Open MPI's default), with a multiple of {self.tp} tasks per node.")

    def on(self, world: int, **changes) -> "Plan":
        """This plan on another number of ranks, with `changes` (not checked: the preflight's what-if)."""
        return dataclasses.replace(self, world=world, **changes)

    @classmethod
    def make(cls, *, model, train, world: int, given: dict, saved: dict | None = None) -> tuple["Plan", dict]:
        """(the plan of the layout flags `given` over a checkpoint's kept modes `saved` on `world` ranks,
        {kept mode: why this run does not take the checkpoint's}); ConfigError with the reason if the
        layout does not fit the model or the world."""
        values, why = _layered(given, saved, world)
        values["det_split"] = values["det_split"] or least_split(values, model)
        if problems := list(_refusals(world, values, model, train.deterministic)):
            raise problems_error(problems)
        zero, stages = Zero(values.pop("zero_stage")), _stages(model.n_layers, values["pp"], values["pp_layers"])
        return cls(world=world, zero=zero, deterministic=train.deterministic, stages=stages, **values), why


def _layered(given: dict, saved: dict | None, world: int) -> tuple[dict, dict]:
    """The given flags over the defaults and the checkpoint's kept modes, a kept grid axis that the world
    cannot hold back at 1, a kept mode about another at its default where that one no longer applies; and why."""
    if not saved:
        return {**DEFAULTS, **given}, {}
    take = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in KEPT and k not in given}
    values = {**DEFAULTS, **take, **given}
    tps, pps = ((values[k],) if k in given else (values[k], 1) for k in ("tp", "pp"))   # a given one is kept
    tp, pp = next(((t, p) for t in tps for p in pps if world % (t * p) == 0), (values["tp"], values["pp"]))
    why = {name: f"the checkpoint's --{name} {values[name]} x --{other} {values[other]} does not divide the {world} "
                 f"rank{'s' if world > 1 else ''}; --{name} K chooses"
           for name, other, now in (("tp", "pp", tp), ("pp", "tp", pp)) if now != values[name]}
    values.update(tp=tp, pp=pp)
    applies = {"pp_schedule": pp > 1, "pp_layers": 1 < pp == saved.get("pp"), "reshard": values["zero_stage"] >= 2}
    values.update({name: DEFAULTS[name] for name, ok in applies.items() if name in take and not ok})
    return values, why


def _refusals(world: int, v: dict, model, deterministic: bool):
    """Each reason the layout `v` does not fit the model or the world, or is not run (one sentence each)."""
    tp, pp, cp, stage, reshard = v["tp"], v["pp"], v["cp"], v["zero_stage"], v["reshard"]
    bad = [(flag, k) for flag, k in (("--tp", tp), ("--pp", pp), ("--cp", cp)) if not isinstance(k, int) or k < 1]
    yield from (f"{flag} must be a positive integer, got {k!r}; 1 turns that axis off." for flag, k in bad)
    if bad:
        return
    if world % (tp * pp):
        yield (f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {world} ranks: the grid is (ranks / (tp x "
               f"pp)) data-parallel replicas of tp x pp ranks. Launch a multiple of {tp * pp} ranks, or choose --tp "
               f"and --pp whose product divides {world}.")
    elif cp > 1 and world // (tp * pp) % cp:
        yield (f"--cp {cp} does not divide the {world // (tp * pp)} ranks per tensor- and pipeline-parallel "
               f"position (the world / (tp x pp)): each data-parallel replica splits its sequences over cp ranks. "
               f"Choose a --cp that divides {world // (tp * pp)}, or launch a multiple of {cp} x tp x pp ranks.")
    if model.n_heads % tp:
        yield (f"--tp {tp} does not divide n_heads {model.n_heads}: attention is split by whole heads. Use a --tp "
               f"that divides {model.n_heads}.")
    if pp > model.n_layers:
        yield (f"--pp {pp} is more pipeline stages than the model's {model.n_layers} blocks: every stage holds at "
               f"least one block. Use --pp <= {model.n_layers} (or, for a model built here, not --init-from, more "
               f"--n-layers).")
    elif pp > 1 and v["pp_layers"] is not None and stage_problem(model.n_layers, pp, v["pp_layers"]):
        yield stage_problem(model.n_layers, pp, v["pp_layers"])
    if cp > 1 and model.seq_len % (2 * cp):
        yield (f"--cp {cp}: --seq-len {model.seq_len} is not a multiple of 2 x cp = {2 * cp}: the balanced split "
               f"cuts each sequence into 2 x cp equal chunks, cp rank i taking chunks i and 2cp-1-i, so that every "
               f"rank does the same causal attention work. Use a --seq-len divisible by {2 * cp}.")
    if deterministic:
        yield from _split_refusals(v, model)
    if pp == 1 and (v["pp_layers"] is not None or v["pp_schedule"] is not None):
        yield (f"{'--pp-layers' if v['pp_layers'] is not None else '--pp-schedule'} is about pipeline stages: it "
               f"needs --pp K > 1 (docs/pipeline.md).")
    if reshard != "micro-batch" and stage < 2:
        yield (f"--reshard {reshard} is about ZeRO-2/3's sharded gradient and parameters: at --zero-stage {stage} "
               f"the whole gradient is kept through the step anyway. Drop --reshard, or pass --zero-stage 2 or 3 "
               f"(docs/composition.md).")
    if not v["overlap"] and stage > 1 and reshard == "micro-batch" and not deterministic:
        yield (f"--no-overlap is not supported with --zero-stage {stage}: stage {stage} reduces each bucket of the "
               f"gradient as the backward pass makes it, and keeps no whole gradient to reduce after it. Drop "
               f"--no-overlap, or keep the whole gradient through the step with --reshard step, or use "
               f"--zero-stage 1 (docs/composition.md).")


def least_split(v: dict, model) -> int:
    """--det-split's default: 4, or the least power of two that fits the layout and the model (`_split_refusals`)."""
    if not all(isinstance(v[k], int) and v[k] >= 1 for k in ("tp", "cp")):
        return 4                                             # a bad --tp or --cp: its own refusal says why
    return next((s for s in (4, 2, 1, 8, 16, 32, 64) if not any(_split_refusals({**v, "det_split": s}, model))), 4)


def _split_refusals(v: dict, model):
    """Why --det-split S does not cut this model on this layout (--deterministic only): S chunks per sequence, and
    gcd(S, n_heads) pieces per split contraction (a piece of attention is whole heads), tp's ranks holding pieces."""
    s, tp, cp = v["det_split"], v["tp"], v["cp"]
    pieces = math.gcd(s, model.n_heads)
    if pieces % tp or tp & (tp - 1) or (cp > 1 and (s % (2 * cp) or cp & (cp - 1))):
        yield (f"--deterministic cuts each sequence into --det-split {s} chunks and every split contraction into "
               f"gcd({s}, n_heads {model.n_heads}) = {pieces} pieces, the same on every layout: --tp {tp} must be a "
               f"power of two that divides the pieces, 2 x --cp {cp} one that divides the chunks. Choose such a --tp "
               f"and --cp, or another --det-split (a new split: other bits than this one's).")
    if model.seq_len % s:
        yield (f"--det-split {s} must divide --seq-len {model.seq_len}: a chunk is seq_len / S positions. Choose a "
               f"--det-split that divides it.")


def stage_problem(n_layers: int, pp: int, counts: tuple[int, ...]) -> str | None:
    """Why `counts` blocks per stage do not fit the model's n_layers over pp stages (None: they do)."""
    if len(counts) == pp and sum(counts) == n_layers and min(counts) >= 1:
        return None
    balanced = ",".join(str(n_layers // pp + (p < n_layers % pp)) for p in range(pp))
    return (f"--pp-layers {','.join(map(str, counts))} must give {pp} positive block counts (one per stage) that "
            f"add up to the model's {n_layers} blocks, e.g. {balanced}.")


def stage_layers(n_layers: int, pp: int, counts: tuple[int, ...] | None = None) -> list[range]:
    """The blocks of each stage: `counts` if given, else balanced with the remainder on the first
    stages (the last stage, which also holds the final LayerNorm and the LM head, has the fewer)."""
    balanced = tuple(n_layers // pp + (p < n_layers % pp) for p in range(pp))
    counts = balanced if counts is None else counts
    if stage_problem(n_layers, pp, counts):
        raise ConfigError(stage_problem(n_layers, pp, counts))
    starts = [sum(counts[:p]) for p in range(pp + 1)]
    return [range(starts[p], starts[p + 1]) for p in range(pp)]


def _stages(n_layers: int, pp: int, counts: tuple[int, ...] | None) -> tuple:
    """The parameter groups of each stage (capstone.model.params.group_of names); (None,) for one stage."""
    if pp == 1:
        return (None,)
    return tuple((("embed",) if p == 0 else ()) + tuple(f"h{i}" for i in r) + (("head",) if p == pp - 1 else ())
                 for p, r in enumerate(stage_layers(n_layers, pp, counts)))
