"""`Run`: the objects of one training run on its process grid, built once from the configs, started
fresh or resumed.

One build path for every combination of modes: the grid always has its dp, pp and tp axes (size 1
when unused), the model always takes its tensor-parallel group, and the choices are made here,
once: which gradient reducer (bucketed or one-shot, or deterministic), which held-out evaluator,
how checkpoints map this rank's state to the canonical layout, whether tests' faults are on. A
combination the product cannot run is refused here, at start, with the reason (exit 2).

Each piece of state has one owner: `Model` the parameter and gradient buffers, the reducer the
reduced gradient shard, `ZeroAdam` the optimizer shard and the state before its last update (the
guard's undo), `Checkpointer` what was saved, `RunState` the progress a checkpoint restores,
`ReplicaCheck` invariant (b)'s record.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from capstone import checkpoint
from capstone.checkpoint import files, resume
from capstone.checkpoint.cadence import Cadence
from capstone.checkpoint.saver import Checkpointer, RunIdentity
from capstone.cli import RunOptions, Settings, check_preset
from capstone.config import ConfigError, ModelConfig, TrainConfig
from capstone.data import open_data
from capstone.data.heldout import HeldOut
from capstone.data.tokens import identity, load_meta
from capstone.guard import Guard
from capstone.hooks import Hooks
from capstone.model.fingerprint import fingerprint
from capstone.model.gpt import Model
from capstone.model.params import Layout, init_params
from capstone.observe import provenance, report
from capstone.parallel import grid as grids
from capstone.parallel.buckets import BucketReducer
from capstone.parallel.comm import Comm
from capstone.parallel.grid import Grid
from capstone.parallel.reduce import GradReducer
from capstone.parallel.replicas import ReplicaCheck
from capstone.parallel.schedules import Sequential
from capstone.parallel.zero import ROWS, ZeroAdam
from capstone.runtime import preflight
from capstone.state import RunState

TIMEOUT_RECORD = "collective-timeout.json"   # in the run directory, written by a rank whose collective timed out


@dataclass
class Run:
    """Everything one run holds (see the module docstring for who owns what)."""

    grid: Grid
    mcfg: ModelConfig
    tcfg: TrainConfig
    opts: RunOptions
    out: str
    model: Model
    opt: ZeroAdam
    reducer: GradReducer
    schedule: Sequential
    data: object
    heldout: HeldOut
    guard: Guard
    cadence: Cadence
    ckpt: Checkpointer
    state: RunState
    replicas: ReplicaCheck
    hooks: Hooks
    batch_size: int                        # sequences per data-parallel rank per micro-batch
    global_batch: int                      # sequences per optimizer step, over all replicas and micro-batches
    n_params: int                          # of the whole model (a rank may hold a part)
    metrics: report.MetricsLog | None = None
    segment_start: tuple = (None, None)    # (held-out loss, best held-out loss) where this segment began
    resumed_from: str | None = None
    init_from: dict | None = None          # --init-from: the weights this run started from (capstone.finetune)

    def final_fingerprint(self) -> tuple[float, str]:
        """Collective: the fingerprint of the whole model's parameters."""
        return fingerprint(self.ckpt.view.whole(self.model.whole()))


class RunFinished(ConfigError):
    """--resume auto found the run at its last step: nothing to do, and that is success (exit 0)."""


def check_modes(world: int, settings: Settings) -> None:
    """ConfigError (exit 2) for a combination of flags the product does not run, with the reason."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    grids.check(world, opts.tp, opts.pp, mcfg)
    if opts.pp > 1:
        _check_pipeline(settings)
    elif opts.pp_layers is not None or opts.pp_schedule is not None:
        raise ConfigError(f"{'--pp-layers' if opts.pp_layers is not None else '--pp-schedule'} is about pipeline "
                          f"stages: it needs --pp K > 1 (docs/pipeline.md).")
    if tcfg.deterministic and opts.tp > 1:
        raise ConfigError(f"--deterministic is not supported with --tp {opts.tp}: its fixed-order reduction and "
                          f"held-out blocks cover data parallelism only. Drop one of them (docs/composition.md).")
    if tcfg.deterministic and opts.zero_stage > 1:
        raise ConfigError(f"--deterministic is not supported with --zero-stage {opts.zero_stage}: it exchanges each "
                          f"micro-batch's whole gradient in a fixed order, and ZeRO-2/3 keep no whole gradient. Use "
                          f"--zero-stage 1 with --deterministic (docs/composition.md).")
    if not opts.overlap and opts.zero_stage > 1:
        raise ConfigError(f"--no-overlap is not supported with --zero-stage {opts.zero_stage}: stage {opts.zero_stage} "
                          f"reduces each bucket of the gradient as the backward pass makes it, and keeps no whole "
                          f"gradient to reduce after it. Drop --no-overlap, or use --zero-stage 1 "
                          f"(docs/composition.md).")


def _check_pipeline(settings: Settings) -> None:
    """The pipeline's refusals (ConfigError, exit 2), with the reason."""
    from capstone.parallel.pipeline import stage_layers
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    stage_layers(mcfg.n_layers, opts.pp, opts.pp_layers)      # counts that do not fit the model
    if tcfg.deterministic:
        raise ConfigError(f"--deterministic is not supported with --pp {opts.pp}: its fixed-order reduction and "
                          f"held-out blocks cover data parallelism only. Drop one of them (docs/composition.md).")
    if opts.zero_stage > 1:
        raise ConfigError(f"--zero-stage {opts.zero_stage} is not supported with --pp {opts.pp}: ZeRO-2/3 reduce and "
                          f"gather each group once per backward pass, and a pipeline stage runs the backward of "
                          f"its micro-batches between other micro-batches' forwards (as DeepSpeed, which refuses "
                          f"ZeRO-2/3 with pipeline parallelism too). Use --zero-stage 1 with --pp "
                          f"(docs/composition.md).")


def open_run(world: Comm, settings: Settings) -> Run | None:
    """Collective: call on all ranks. Decide fresh or resumed (the checkpoint's settings under the
    explicit flags), build every piece, restore the checkpoint or measure the starting loss. None
    (after one line) when --resume auto finds the run finished: nothing to do."""
    opts = settings.opts
    world.deadline.set_timeout(opts.collective_timeout)
    hooks = _hooks(world, opts)
    hooks.at("start", 0)
    out = world.bcast_json(opts.out or time.strftime("runs/run-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    ckpt_dir = os.path.join(out, "checkpoints")
    check_parallel_io(world)
    check_modes(world.size, settings)                 # bad flags: ConfigError, nothing written
    if opts.tensorboard:
        from capstone.observe.tensorboard import check_writer
        check_writer(world)
    padded = Layout.for_model(settings.model, world.size).padded
    claim = preflight.claim(world, out, ckpt_dir, files.estimated_size(padded * len(ROWS) * 4, world.size))
    try:  # a failed start leaves nothing behind that it created
        path = resume.resolve(world, opts.resume, ckpt_dir)
        if path is not None:
            saved = _agreed(world, lambda: checkpoint.read_meta_file(path))
            check_preset(settings, saved["model_config"], saved["train_config"], path)
            if opts.init_from:
                report.say(f"note: resuming from {path}; --init-from starts a run only, it is not used now", world.rank)
            settings = settings.on_top_of(saved["model_config"], saved["train_config"])
            check_modes(world.size, settings)
        elif settings.deferred:   # --resume auto starting fresh: the flags alone must make a valid run
            raise ConfigError(settings.deferred)
        elif opts.init_from:      # fine-tuning: the source's model and weights (capstone.finetune)
            source, settings = _init_from(world, settings)
        elif settings.train.data and "vocab_size" not in settings.explicit:
            vocab = _agreed(world, lambda: load_meta(settings.train.data).vocab_size)
            settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, vocab_size=vocab))
        tcfg, dp = settings.train, world.size // opts.tp
        preflight.check_memory(world, settings.model, dataclasses.replace(tcfg, batch_size=tcfg.batch_for(dp)), opts)
        run = build(world, settings, out, hooks)
        if path is None and opts.init_from:
            run.init_from = source.describe()
            source.install(run)
        start(run, path, saved["train_config"] if path is not None else None)
    except (ConfigError, checkpoint.CheckpointError) as exc:
        if world.rank == 0:
            claim.undo()
        if isinstance(exc, RunFinished):   # a requeued batch job whose work is done
            report.say(f"capstone: {exc}", world.rank)
            return None
        raise
    return run


def _init_from(world: Comm, settings: Settings):
    """--init-from on a fresh start: (the Source, the settings with its model), the new data's
    vocabulary checked against the source's (ConfigError/CheckpointError on every rank)."""
    from capstone import finetune
    source = finetune.fetch(world, settings.opts.init_from)
    data = settings.train.data
    finetune.check_vocabulary(source, _agreed(world, lambda: identity(load_meta(data))) if data else {}, data)
    settings = dataclasses.replace(settings, model=finetune.model_for(settings, source))
    check_modes(world.size, settings)
    return source, settings


def build(world: Comm, settings: Settings, out: str, hooks: Hooks | None = None) -> Run:
    """Collective: call on all ranks. Fresh objects on a new grid; the initial parameters are
    broadcast from each data-parallel group's rank 0."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    hooks = _hooks(world, opts) if hooks is None else hooks
    world.deadline.set_timeout(opts.collective_timeout)
    world.deadline.record_to(os.path.join(out, TIMEOUT_RECORD))   # for the batch script's watchdog
    grid = Grid.build(world, opts.tp, opts.pp)
    dp, tp = grid.dp, grid.tp
    batch = tcfg.batch_for(dp.size)
    stages = [None]                   # the parameter groups of each pipeline stage (None: all)
    if grid.pp.size > 1:
        from capstone.parallel import pipeline
        stages = pipeline.stage_groups(mcfg.n_layers, grid.pp.size, opts.pp_layers)
        if tcfg.grad_accum < grid.pp.size and world.rank == 0:
            report.say(f"warning: {tcfg.grad_accum} micro-batches (--grad-accum) through {grid.pp.size} pipeline "
                       f"stages: each stage idles (p-1)/(m+p-1) = {(grid.pp.size - 1) / (tcfg.grad_accum + grid.pp.size - 1):.0%} "
                       f"of the step (the bubble); raise --grad-accum to at least {grid.pp.size}.")
    layout = Layout.for_model(mcfg, dp.size, tp.size, stages[grid.pp.rank % len(stages)])
    full = Layout.for_model(mcfg, world.size)
    view, params = _initial(grid, mcfg, tcfg, layout, full, stages, sharded=opts.zero_stage == 3)
    data, data_identity = open_data(mcfg, tcfg, batch)
    model, reducer, replicas = _model_and_reducer(grid, layout, params, settings)
    heldout = _heldout(grid, data, settings)
    adam = ZeroAdam
    if opts.zero_stage == 3:      # the parameters are a shard too
        from capstone.parallel.zero3 import ShardedAdam as adam
    opt = adam(dp, layout, model.params, (tcfg.beta1, tcfg.beta2), tcfg.eps, tcfg.weight_decay, tcfg.clip)
    identity = RunIdentity(mcfg, tcfg, data_identity, batch * tcfg.grad_accum * dp.size)
    cadence = Cadence(tcfg, world.rank, opts.stop_after)
    ckpt = Checkpointer(world, os.path.join(out, "checkpoints"), full, identity, cadence, view, hooks)
    state = RunState()
    guard = Guard(tcfg.spike_factor, tcfg.max_rollbacks, state.guard)
    scale = 1.0 / (identity.global_batch * mcfg.seq_len)
    schedule = Sequential(model, reducer, hooks, scale)
    if grid.pp.size > 1:
        schedule = pipeline.Pipeline(model, reducer, hooks, scale, opts.pp_schedule or "1f1b")
    return Run(grid, mcfg, tcfg, opts, out, model, opt, reducer, schedule, data, heldout, guard, cadence, ckpt,
               state, replicas, hooks, batch, identity.global_batch, full.n_params)


def _hooks(world: Comm, opts: RunOptions) -> Hooks:
    """The test seam: fault injection when a test asks for it (capstone.faults), else nothing."""
    hooks = Hooks()
    if os.environ.get("CAPSTONE_FAULT") or os.environ.get("CAPSTONE_FAULT_PIDS") or opts.inject_lr_spike \
            or opts.inject_nan or opts.sleep_per_step or opts.inject_grad_sign or opts.inject_no_update:
        from capstone.faults import Faults
        hooks = Faults(world.rank, opts.inject_lr_spike, opts.inject_nan, opts.sleep_per_step, opts.inject_grad_sign,
                       opts.inject_no_update)
    world.hooks = hooks   # every collective is a hook point (capstone.parallel.comm)
    return hooks


def _initial(grid: Grid, mcfg, tcfg, layout: Layout, full: Layout, stages: list, sharded: bool):
    """(the checkpoints' view of this rank's state, its initial parameters): the 1-rank run's, made
    by rank 0 of each data-parallel group (ZeroAdam broadcasts them), or (ZeRO-3) by every rank,
    which keeps its shard; a model-parallel rank takes its part: its pipeline stage's `stages`
    groups, its tensor-parallel slice (capstone.parallel.canonical)."""
    dp, tp = grid.dp, grid.tp
    view, make = None, dp.rank == 0 or sharded
    if grid.mp.size > 1:
        from capstone.parallel import canonical, tensor
        view = canonical.Canonical(grid, mcfg, layout, full, stages)
        groups = stages[grid.pp.rank % len(stages)]
        params = tensor.initial_params(mcfg, layout, tcfg.seed, tp.size, tp.rank, groups) if make else layout.zeros()
    else:
        params = init_params(layout, mcfg, tcfg.seed) if make else layout.zeros()
    if sharded:
        lo, hi = layout.shard_range(dp.rank)
        params = params[lo:hi].copy()
    return view, params


def _model_and_reducer(grid: Grid, layout: Layout, params, settings: Settings):
    """(model, gradient reducer, replica check) of the run's modes: deterministic, or ZeRO stage 1
    (the flat gradient buffer, buckets), 2 (no gradient buffer: capstone.parallel.zero2) or 3 (no
    whole parameters either: capstone.parallel.zero3)."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    weight = _loss_weight(grid)
    if tcfg.deterministic:   # fixed-order sums (capstone.parallel.deterministic)
        from capstone.parallel import deterministic as det
        if opts.overlap and grid.world.rank == 0:
            report.say("note: --deterministic exchanges each micro-batch's gradient after its backward pass, in a "
                       "fixed order; the bucketed overlap (--bucket-mb) does not apply.")
        model = Model(mcfg, layout, params, grid.tp, opts.recompute)
        return (model, det.DeterministicReducer(grid, layout, model.grads, tcfg.grad_accum),
                ReplicaCheck(grid, layout, lambda p, strong: det.fingerprint(p, layout.n_params)))
    floats = int(opts.bucket_mb * 2**20) // 4 if opts.overlap else layout.padded
    if grid.pp.size > 1:   # a pipeline stage (capstone.parallel.pipeline), ZeRO-1
        from capstone.parallel.pipeline import StageModel
        model = StageModel(mcfg, layout, params, grid.tp, opts.recompute, grid.pp)
        return model, BucketReducer(grid, layout, model.grads, floats, weight), ReplicaCheck(grid, layout)
    if opts.zero_stage == 1:
        model = Model(mcfg, layout, params, grid.tp, opts.recompute)
        return model, BucketReducer(grid, layout, model.grads, floats, weight), ReplicaCheck(grid, layout)
    from capstone.parallel.progress import Progress
    from capstone.parallel.zero2 import ShardedGradReducer
    reducer = ShardedGradReducer(grid, layout, floats, Progress(), weight)
    if opts.zero_stage == 2:
        return Model(mcfg, layout, params, grid.tp, opts.recompute, grads=False), reducer, ReplicaCheck(grid, layout)
    from capstone.parallel import zero3
    model = zero3.ShardedModel(mcfg, layout, params, grid, opts.recompute, reducer)
    return model, reducer, zero3.ShardedReplicaCheck(grid, layout, model.gatherer)


def _loss_weight(grid: Grid) -> float:
    """1 on the ranks whose loss is their replica's (the last pipeline stage's tensor-parallel rank 0)."""
    return 1.0 if grid.tp.rank == 0 and grid.pp.rank == grid.pp.size - 1 else 0.0


def _heldout(grid: Grid, data, settings: Settings) -> HeldOut:
    """The held-out evaluation: rows split over the data-parallel group (deterministic: fixed blocks)."""
    tcfg, T = settings.train, settings.model.seq_len
    if tcfg.deterministic:
        from capstone.parallel import deterministic as det
        return det.HeldOutBlocks(data, tcfg.eval_batches, tcfg.eval_batch_size, T, grid.world, grid.dp)
    weight = _loss_weight(grid)
    return HeldOut(data, tcfg.eval_batches, tcfg.eval_batch_size, T, grid.world, grid.dp.rank, grid.dp.size, weight)


def start(run: Run, path: str | None = None, saved_train: dict | None = None) -> None:
    """Collective: call on all ranks. Restore checkpoint `path` (None: measure the starting loss
    of a fresh run), then open metrics.jsonl."""
    world = run.grid.world
    if path is not None:
        _resume(run, path, saved_train if saved_train is not None else dataclasses.asdict(run.tcfg))
    else:
        run.state.eval_start = run.state.best_eval = run.heldout.measure(run.model)
        run.guard.state.last_eval = run.state.eval_start
    if world.rank == 0:
        os.makedirs(run.out, exist_ok=True)
    run.ckpt.provenance = provenance.collect(world)   # into summary.json and every checkpoint's metadata
    if run.init_from is not None:
        run.ckpt.provenance["init_from"] = run.init_from
    run.metrics = report.MetricsLog(os.path.join(run.out, "metrics.jsonl") if world.rank == 0 else None)
    run.metrics.write({"event": "start", "world": world.size, "grid": run.grid.describe(),
                       "start_step": run.state.step, "resumed_from": run.resumed_from, "time": time.time(),
                       "provenance": run.ckpt.provenance, "train_config": dataclasses.asdict(run.tcfg),
                       "model_config": dataclasses.asdict(run.mcfg)})


def _agreed(world: Comm, read):
    """Rank 0 runs `read()`; its value, or its ConfigError/CheckpointError, reaches every rank."""
    if world.rank == 0:
        try:
            value = {"value": read()}
        except (ConfigError, checkpoint.CheckpointError) as exc:
            value = {"error": str(exc), "config": isinstance(exc, ConfigError)}
    got = world.bcast_json(value if world.rank == 0 else None)
    if "error" in got:
        raise (ConfigError if got["config"] else checkpoint.CheckpointError)(got["error"])
    return got["value"]


def check_parallel_io(world: Comm) -> None:
    if checkpoint.mpi_io_available():
        return
    if world.size == 1:
        report.say("note: h5py has no MPI support; one rank writes the same checkpoint format with serial "
                   "h5py. More ranks need h5py built against parallel HDF5 (scripts/setup).", world.rank)
        return
    raise ConfigError("h5py has no MPI support, so the ranks cannot write one shared checkpoint file. "
                      "Run scripts/setup (it builds h5py against parallel HDF5: CC=mpicc HDF5_MPI=ON "
                      "HDF5_DIR=<prefix> pip install --no-build-isolation --no-binary=h5py h5py), "
                      "or run on one rank, which writes the same format with serial h5py.")


def _resume(run: Run, path: str, saved: dict) -> None:
    shard, state, meta = run.ckpt.load(path)
    run.opt.load_state(shard)
    run.guard.state = state.guard
    run.state, run.resumed_from = state, path
    run.init_from = (meta.get("provenance") or {}).get("init_from")
    run.segment_start = (state.guard.last_eval, state.best_eval)
    if state.step >= run.tcfg.steps:
        if run.opts.resume == "auto":   # a requeued batch job whose work is done
            raise RunFinished(f"{path} is at step {state.step}, the last of --steps {run.tcfg.steps}: the run is "
                              f"finished, nothing to do (summary.json and metrics.jsonl are as they were). Pass "
                              f"--steps larger than {state.step} to train on.")
        raise ConfigError(f"{path} is at step {state.step} and --steps is {run.tcfg.steps}: nothing left to do. "
                          f"Pass --steps larger than {state.step} to train on.")
    changed = {k: (v, getattr(run.tcfg, k)) for k, v in saved.items() if getattr(run.tcfg, k, v) != v}
    if meta.get("global_batch", run.global_batch) != run.global_batch:   # batch_size x grad_accum x replicas
        changed["global batch (sequences per step)"] = (meta["global_batch"], run.global_batch)
    report.resumed(path, state, meta["world_size"], run.grid.world.size, changed, run.grid.world.rank)
