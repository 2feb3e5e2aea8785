"""Command line of `python -m capstone.train`: flags -> validated configs and run options.

Settings are layered: the dataclass defaults, then `--preset`, then (on resume) the checkpoint's
own settings, then the flags given explicitly, which always win.
"""

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

from capstone import plan

from capstone.flags import usage
from capstone.config import ConfigError, ModelConfig, TrainConfig, problems_error
from capstone.flags.options import RunOptions
from capstone.flags.presets import PRESETS, preset_values


@dataclass(frozen=True)
class Settings:
    """The parsed command line: configs, options, and which config fields were given explicitly."""

    model: ModelConfig
    train: TrainConfig
    opts: RunOptions
    explicit: dict   # field name -> value, for the config flags on the command line
    preset: str | None = None   # --preset NAME, when given
    deferred: str | None = None  # resuming: why the flags alone make no valid config (judged over the checkpoint's)
    flags: dict = dataclasses.field(default_factory=dict)          # the config flags on the command line only
    preset_values: dict = dataclasses.field(default_factory=dict)  # the preset's (its warmup fitted to the run)
    notes: tuple = ()           # what a fresh start says about its settings (a shortened warmup)
    layout: dict = dataclasses.field(default_factory=dict)   # the layout flags given (capstone.plan.Plan.make)

    def on_top_of(self, model: dict, train: dict) -> "Settings":
        """These settings over a checkpoint's (explicit flags win); raises ConfigError if invalid."""
        m = ModelConfig(**_pick(ModelConfig, {**model, **self.explicit}))
        t = TrainConfig(**_pick(TrainConfig, {**train, **self.explicit}))
        return dataclasses.replace(self, model=m, train=t)


def _pick(cls, values: dict) -> dict:
    return {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}


HELP = "Run `python -m capstone.train --help` for every flag and its meaning."
_BAD = object()   # a flag's value that failed its type or choices (reported with the others)


class _Parser(argparse.ArgumentParser):
    """Bad syntax raises ConfigError (printed once, by rank 0) instead of printing on every rank; a bad
    value is collected in `bad` so that every bad flag is reported at once (`parse`)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.bad: list[str] = []

    def error(self, message):
        raise ConfigError(f"{message}. {HELP}")

    def _get_values(self, action, arg_strings):
        try:
            return super()._get_values(action, arg_strings)
        except argparse.ArgumentError as exc:
            self.bad.append(f"{exc}.")
            return _BAD


_DEFAULTS = {**dataclasses.asdict(ModelConfig()), **dataclasses.asdict(TrainConfig())}   # config field -> default


def _flags(group, *flags: tuple[str, str], **kw) -> None:
    """Config flags (name, help): no argparse default (so explicit flags can be told apart), the default in the help."""
    for name, help in flags:
        default = _DEFAULTS[name]
        group.add_argument("--" + name.replace("_", "-"), type=type(default), help=f"{help} (default: {default!r})",
                           **kw)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m capstone.train", argument_default=argparse.SUPPRESS,
                description="Train the MiniGPT on MPI (data, tensor and pipeline parallelism; ZeRO stages 0-3) with "
                            "sharded HDF5 checkpoints; run under mpirun/srun (any number of ranks). Checks the four "
                            "invariants and exits non-zero if one fails.")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="named settings (capstone/flags/presets.py); explicit flags override them; on --resume the "
                        "checkpoint's settings win and a preset that contradicts them is refused "
                        "(default: 'reference')")
    g = p.add_argument_group("model")
    _flags(g, ("vocab_size", "vocabulary size V (with --data: the data's)"), ("seq_len", "sequence length T"),
           ("d_model", "model width C"), ("n_heads", "attention heads H (must divide d-model)"),
           ("n_layers", "transformer blocks L"))
    g.add_argument("--bias", action=argparse.BooleanOptionalAction,
                   help="biases in the blocks and LayerNorms (default: yes, as GPT-2; --no-bias: nanoGPT's bias=False)")
    g.add_argument("--no-head-bias", dest="head_bias", action="store_false",
                   help="no bias in the LM head, as GPT-2 (needed by `capstone.export --format hf`; default: a bias)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction,
                   help="the LM head is the token embedding wte (GPT-2's weight tying; its gradient is the sum of "
                        "both uses; default: a head of its own; --no-tie-embeddings unties a preset's)")
    g.add_argument("--dropout", type=float, metavar="P", help="dropout probability at GPT-2's three sites while "
                   "training, the same mask on any grid (docs/gpt2.md; default: 0.0)")
    g = p.add_argument_group("data and training")
    _flags(g, ("data", "directory made by `python -m capstone.prepare` ('' for the synthetic corpus)"),
           ("seed", "seed of the initial parameters and of the data order"), ("steps", "optimizer steps of the run"),
           ("batch_size", "sequences per rank per micro-batch"),
           ("global_batch", "sequences per step over all ranks (0: batch-size x grad-accum x ranks)"),
           ("grad_accum", "micro-batches summed per optimizer step (0: --global-batch / (replicas x --batch-size))"),
           ("lr", "peak learning rate"),
           ("warmup_steps", "linear warmup steps"), ("min_lr", "final learning rate of the cosine schedule"),
           ("beta1", "Adam beta1"), ("beta2", "Adam beta2"), ("eps", "Adam epsilon"),
           ("weight_decay", "decoupled (AdamW) weight decay of matrices"),
           ("clip", "clip the global gradient norm to this (0: off)"),
           ("corpus_tokens", "length of the synthetic corpus"), ("corpus_seed", "seed of the synthetic corpus"),
           ("eval_every", "held-out evaluation every K steps (and at checkpoints and the last step)"),
           ("eval_batches", "held-out batches per evaluation"), ("eval_batch_size", "sequences per held-out batch"),
           ("loss_tol", "invariant (a): an evaluation may rise by this (float noise) ..."),
           ("loss_tol_rel", "... plus this fraction of the decrease achieved so far"))
    _flags(g, ("lr_schedule", "decay after warmup"), choices=("constant", "cosine"))
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                   help="every sum in a fixed order: every layout (ranks x grad-accum, --tp, --pp, --cp, --zero-stage) "
                        "of the same global batch and batch size gives the same bits (docs/deterministic.md; default: "
                        "off; on --resume: the checkpoint's; --no-deterministic resumes such a run without it)")
    g = p.add_argument_group("checkpoints and guard")
    _flags(g, ("ckpt_every", "checkpoint every K steps (0: off)"),
           ("ckpt_every_minutes", "also checkpoint after this many minutes of wall clock (0: off)"),
           ("keep_last", "keep the newest K checkpoints and the run's first (0: all)"),
           ("spike_factor", "roll back when a loss exceeds this factor times the last accepted one"),
           ("max_rollbacks", "stop with an error after this many triggers without an accepted update"))
    g.add_argument("--memory-tier", type=int, nargs="?", const=1, metavar="K",
                   help="keep every K-th step (1 if not given) in the nodes' memory, a copy on another node; --resume "
                        "auto takes the newest the nodes hold if newer than the disk's (docs/running.md; default: off)")
    g.add_argument("--guard-undo", action=argparse.BooleanOptionalAction,
                   help="--no-guard-undo: do not keep the optimizer state from before each update (12 bytes per "
                        "parameter / N): the guard still skips a bad batch (non-finite or spiking loss or norm) but "
                        "cannot undo an update; one that makes the state non-finite ends the run (exit 1, not saved) "
                        "(docs/design.md, the divergence guard; default: undo; on --resume: the checkpoint's)")
    _finetune_flags(p)
    _run_flags(p)
    _layout_flags(p)
    _test_hooks(p)
    return p


def _run_flags(p) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--out", help="run directory; checkpoints go to OUT/checkpoints (default: the run directory of "
                                 "--resume PATH, else runs/run-<time>)")
    g.add_argument("--resume",
                   help="checkpoint to continue from: a ckpt-*.h5 path or a run directory; 'latest' (the newest in "
                        "OUT); or 'auto' (the newest that verifies, setting corrupt ones aside as *.corrupt-*; a fresh "
                        "start if there is none). Its settings are used unless given as flags")
    g.add_argument("--quiet", action="store_true", help="print only errors and the one-line result")
    g.add_argument("--log-every", type=int, metavar="K",
                   help="console: 1 prints the full per-step table; K > 1 prints a short line (smoothed loss, "
                        "tokens/s, elapsed, ETA) every K steps, every step with an event and every evaluation "
                        "(0: 1 when --steps <= 100, else about steps/50)")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="also write the step rows as TensorBoard scalars to DIR (needs: pip install tensorboardX)")
    g.add_argument("--collective-timeout", type=float, metavar="SECONDS",
                   help="abort the job with a clear message when a collective (gradient reduce, allgather, "
                        "agreement, checkpoint barrier) has waited this long: a peer is dead or unreachable "
                        "(0: automatic, max(300 s, 20 x the longest step so far); docs/multinode.md)")
    g.add_argument("--ckpt-async", action=argparse.BooleanOptionalAction,
                   help="write checkpoints behind training: the step copies its optimizer shard and the run state "
                        "into a snapshot buffer (12 bytes per parameter / ranks) and goes on while a thread writes, "
                        "publishes and rotates the file exactly as a synchronous save; --no-ckpt-async writes "
                        "them in the step (docs/checkpoints.md; default: on)")


def _layout_flags(p) -> None:
    """How the run is laid out on its ranks: the flags that make its plan (capstone.plan)."""
    g = p.add_argument_group("layout (one plan: capstone/plan.py)")
    g.add_argument("--tp", type=int, metavar="K",
                   help="tensor parallelism: K consecutive ranks split each block (Megatron-style) and the "
                        "ranks / K replicas run data parallelism at the --zero-stage (docs/tensor-parallel.md; "
                        "default: 1; on --resume: the checkpoint's, if the ranks hold it)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="reduce the gradient in one collective after the backward pass (a reduce-scatter; at "
                        "--zero-stage 0 an allreduce), instead of in buckets started during it (at --zero-stage 2/3: "
                        "with --reshard step only)")
    g.add_argument("--bucket-mb", type=float, metavar="MB",
                   help="bucket size of the overlapped gradient reduce-scatter (default: 1.0)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO over the data-parallel group: 0 shards nothing (plain data parallelism, DDP: every "
                        "rank holds the whole optimizer state; the gradient allreduced in buckets), 1 shards the "
                        "optimizer state, 2 also the gradients (reduced into the shard as the backward makes them), "
                        "3 also the parameters (gathered block by block, one ahead) (docs/performance.md; default: 1; "
                        "on --resume: the checkpoint's)")
    g.add_argument("--reshard", choices=("micro-batch", "step"),
                   help="ZeRO-2/3 with several micro-batches (--grad-accum, --pp): 'micro-batch' gathers a block's "
                        "parameters (stage 3) for each micro-batch's forward and backward and reduce-scatters each "
                        "micro-batch's gradient (least memory); 'step' keeps what the step gathered and accumulates "
                        "the whole gradient through its micro-batches: one gather and one reduce-scatter per step, "
                        "more memory (torchtitan's choice under a pipeline) (docs/composition.md; default: "
                        "micro-batch; on --resume: the checkpoint's)")
    g.add_argument("--recompute", action=argparse.BooleanOptionalAction,
                   help="activation checkpointing: keep only each block's input and recompute the block in the "
                        "backward pass (the same gradients, about a third more compute, far less memory; default: "
                        "off; on --resume: the checkpoint's; --no-recompute resumes such a run without it)")
    g.add_argument("--pp", type=int, metavar="K",
                   help="pipeline parallelism: the blocks in K contiguous stages on K ranks of the grid's pp axis, "
                        "the step's --grad-accum micro-batches flowing through them (docs/pipeline.md; default: 1; "
                        "on --resume: the checkpoint's, if the ranks hold it)")
    g.add_argument("--cp", type=int, metavar="K",
                   help="context parallelism: each sequence split over K ranks (balanced: 2K chunks, rank i taking "
                        "i and 2K-1-i), attention a causal ring passing keys and values; --seq-len a multiple of 2K "
                        "(docs/context-parallel.md; default: 1; not kept by checkpoints: resume at any --cp)")
    g.add_argument("--pp-schedule", choices=("1f1b", "afab", "zb-h1"),
                   help="the pipeline's order of forwards and backwards: 1f1b (one forward one backward, at most "
                        "K micro-batches of activations per stage), afab (all forwards, then all backwards: "
                        "GPipe) or zb-h1 (1f1b with each backward split, the weights' gradients filling the "
                        "bubble, the update checked after it is made) (default: 1f1b; on --resume: the checkpoint's)")
    g.add_argument("--det-split", type=int, metavar="S",
                   help="--deterministic's S chunks per sequence and pieces per contraction (default: 4 or what fits)")
    g.add_argument("--precision", choices=("fp32", "bf16"),
                   help="bf16: bfloat16 working parameters, kept activations and gradient messages over a float32 "
                        "master, m and v (docs/precision.md; default: fp32; on --resume: the checkpoint's)")
    g.add_argument("--pp-layers", type=usage.counts, metavar="N,N,...",
                   help="blocks per pipeline stage, e.g. 3,3,2 (default: balanced, the first stages taking one "
                        "more when K does not divide the blocks; fewer on the last stage eases a heavy LM head; "
                        "'balanced' to say so on --resume, which keeps the checkpoint's)")


def _finetune_flags(p) -> None:
    """Fine-tuning and the best checkpoint (issue 28), in their own group."""
    g = p.add_argument_group("fine-tuning and the best checkpoint")
    g.add_argument("--init-from", metavar="CKPT",
                   help="start a new run (fresh optimizer, schedule and step count) from the weights of a capstone "
                        "checkpoint (a ckpt-*.h5 file or a run directory) or of an export (.safetensors); the model "
                        "settings come from it, the training settings from its run (an export: fine-tuning "
                        "defaults) unless given as flags; --data may differ if its vocabulary is the same "
                        "(docs/finetune.md)")
    g.add_argument("--keep-best", action="store_true",
                   help="also save a checkpoint whenever an evaluation improves the best held-out loss, in "
                        "OUT/checkpoints/best (the newest best only; apart from --keep-last; default: off)")


def _test_hooks(p) -> None:
    """The test hooks (fault injection, capstone.runtime.faults), after the others; RunOptions has their defaults."""
    g = p.add_argument_group("test hooks (fault injection, not for training)")
    g.add_argument("--stop-after", type=int, help="checkpoint and stop after this step, as if preempted (0: off)")
    g.add_argument("--sleep-per-step", type=float, help="sleep this many seconds per step")
    g.add_argument("--inject-lr-spike", type=usage.spike, metavar="STEP:MULT",
                   help="multiply the learning rate of step STEP by MULT")
    g.add_argument("--inject-nan", type=usage.nan_at, metavar="STEP[:COUNT]",
                   help="make the gradient NaN at STEP (and the COUNT-1 steps after)")
    g = p.add_argument_group("test hooks for invariant (a)")
    g.add_argument("--inject-grad-sign", type=usage.from_step, metavar="STEP[:COUNT]",
                   help="negate the summed gradient from step STEP on (COUNT steps; default: to the end)")
    g.add_argument("--inject-no-update", type=usage.from_step, metavar="STEP[:COUNT]",
                   help="zero the summed gradient before the optimizer from step STEP on (COUNT steps; default: "
                        "to the end): from step 1, no update is ever applied")


def parse(argv=None) -> Settings:
    """Parse and validate: ConfigError (what to do, every bad flag at once) on bad values; SystemExit on --help."""
    parser = build_parser()
    namespace, extras = parser.parse_known_args(argv)
    values = {k: v for k, v in vars(namespace).items() if v is not _BAD}
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    problems = parser.bad + usage.unknown(extras, known)
    problems, syntax = problems + usage.option_problems(values) + usage.checked(values, plan.CHECKS), bool(problems)
    name = values.pop("preset", None)
    opts = _pick(RunOptions, values)
    layout = {k: v for k, v in values.items() if k in plan.DEFAULTS}
    explicit = {k: v for k, v in values.items() if k not in opts and k not in layout}
    preset, note = preset_values(name, explicit)
    resuming = opts.get("resume") is not None
    try:
        model, train, deferred = _configs({**preset, **explicit}, resuming)
    except ConfigError as exc:
        problems += [usage.as_flag(p, _DEFAULTS.keys()) for p in exc.problems]
    if problems:
        error = problems_error(problems)
        raise ConfigError(f"{error} {HELP}" if syntax else str(error), error.problems)
    return Settings(model, train, RunOptions(**opts), explicit if resuming else {**preset, **explicit}, name, deferred,
                    explicit, preset, (note,) if note and not resuming else (), layout)


def _configs(base: dict, resuming: bool) -> tuple[ModelConfig, TrainConfig, str | None]:
    """The configs of `base`. Resuming, a combination they refuse (e.g. --warmup-steps above the default
    --steps) is judged later, over the checkpoint's settings (`on_top_of`), or raised if there is none."""
    made, problems = [], []
    for cls in (ModelConfig, TrainConfig):   # both judged: every bad flag at once
        try:
            made.append(cls(**_pick(cls, base)))
        except ConfigError as exc:
            problems += exc.problems
    if not problems:
        return made[0], made[1], None
    if not resuming:
        raise problems_error(problems)
    return ModelConfig(), TrainConfig(), str(problems_error(problems))


def parse_on_every_rank(argv, rank: int) -> Settings:
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
