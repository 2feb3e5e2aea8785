"""`Run`: the objects of one training run on its process grid, built once from the configs, started
fresh or resumed.

One build path for every combination of modes: the grid always has its dp, pp and tp axes (size 1
when unused), the model always takes its tensor-parallel group, and the choices are made once,
when the run is built (capstone.modes: which combinations run, and what each mode makes: model,
gradient reducer, optimizer, held-out evaluator, schedule, the checkpoints' view); here: whether
tests' faults are on, fresh or resumed, the start-up checks. A combination the product cannot
run is refused at start, with the reason (exit 2).

What a run holds, and who owns each piece, is `capstone.roles.Run`.
"""

import dataclasses
import os
import time

from capstone import checkpoint, modes
from capstone.checkpoint import background, files, judge, kept, recover, resume, rundir
from capstone.checkpoint.cadence import Cadence
from capstone.checkpoint.saver import Checkpointer, RunIdentity
from capstone.cli import Settings
from capstone.flags.presets import check_preset
from capstone.collective.agree import agreed
from capstone.config import ConfigError
from capstone.flags.options import RunOptions
from capstone.data import open_data
from capstone.data.tokens import identity, load_meta
from capstone.step.guard import Guard
from capstone.step.hooks import Hooks
from capstone.model.params import Layout
from capstone.observe import provenance, report
from capstone.collective.comm import Comm
from capstone.parallel.grid import Grid
from capstone.plan import Plan
from capstone.roles import Run
from capstone.runtime import ending, preflight
from capstone.step.state import ROWS, RunState

TIMEOUT_RECORD = "collective-timeout.json"   # in the run directory, written by a rank whose collective timed out


class RunFinished(ConfigError):
    """--resume auto found the run at its last step: nothing to do, and that is success (exit 0)."""


def open_run(world: Comm, settings: Settings) -> Run | None:
    """Collective: call on all ranks. Decide fresh or resumed (the checkpoint's settings under the
    explicit flags), build every piece, restore the checkpoint or measure the starting loss. None
    (after one line) when --resume auto finds the run finished: nothing to do."""
    opts = settings.opts
    world.deadline.set_timeout(opts.collective_timeout)
    hooks = _hooks(world, opts)
    hooks.at("start", 0)
    out, settings, claim = _claimed(world, settings)
    try:  # a failed start leaves nothing behind that it created
        path, saved, settings, source = _starting_point(world, settings, os.path.join(out, "checkpoints"))
        plan, why = Plan.make(model=settings.model, train=settings.train, world=world.size, given=settings.layout,
                              saved=saved.get("modes"))   # the checkpoint's modes ({} on a fresh start)
        _check_memory(world, settings, plan)
        run = build(world, settings, out, hooks, plan)
        if source is not None:   # --init-from on a fresh start
            run.init_from = source.describe()
            source.install(run)
        for line in settings.notes if path is None else ():
            report.say(line, world.rank)
        run.state.run_id = _agreed(world, lambda: (rundir.occupant(out) or {}).get("run_id") or rundir.new_id())
        start(run, path, saved.get("train_config"), why)
        if world.rank == 0 and claim.lock is not None:
            claim.lock.label(run_id=run.state.run_id)
    except (ConfigError, checkpoint.CheckpointError) as exc:
        if world.rank == 0:
            claim.undo()
        if isinstance(exc, RunFinished):   # a requeued batch job whose work is done
            report.say(f"capstone: {exc}", world.rank)
            return None
        raise
    return run


def _claimed(world: Comm, settings: Settings):
    """Collective. The run directory, the settings checked against the layout, and this run's claim on
    the directory (its lock and the disk's space), after the checks that need no checkpoint."""
    opts = settings.opts
    out, note = world.bcast_json(_out_dir(opts) if world.rank == 0 else None)
    if note:
        report.say(note, world.rank)
    check_parallel_io(world)
    settings, plan = _checked(world, settings)       # a bad layout: ConfigError, nothing written
    if opts.resume is None and not opts.init_from:   # a fresh model's memory is known: said before the disk's space
        _check_memory(world, settings, plan)
    if opts.tensorboard:
        from capstone.observe.tensorboard import check_writer
        check_writer(world)
    padded = Layout.for_model(settings.model, world.size).padded
    claim = preflight.claim(world, out, os.path.join(out, "checkpoints"),
                            files.estimated_size(padded * len(ROWS) * 4, world.size))
    if world.rank == 0 and (said := ending.previous(out)):   # the last launch here left no record: now it has one
        report.say(said)
    return out, settings, claim


def _starting_point(world: Comm, settings: Settings, ckpt_dir: str):
    """Collective. (checkpoint path or None, its metadata, the settings over it, the --init-from source):
    a resume takes the checkpoint's settings under the explicit flags, a fine-tuning run its source's
    model, a fresh run on prepared data the data's vocabulary."""
    opts, saved, source = settings.opts, {}, None
    memory = recover.newest(world, os.path.dirname(ckpt_dir), settings.train.memory_tier > 0) if (
        opts.resume == "auto") else None   # the memory tier first: nothing of the disk is read for it
    path = memory or resume.resolve(world, opts.resume, ckpt_dir)
    if path is not None:
        saved = memory.meta if memory else _agreed(world, lambda: checkpoint.read_meta_file(path))
        check_preset(settings.preset, settings.explicit, saved["model_config"], saved["train_config"], path)
        _check_same_data(world, settings, saved, path)
        if opts.init_from:
            report.say(f"note: resuming from {path}; --init-from starts a run only, it is not used now", world.rank)
        settings = settings.on_top_of(saved["model_config"], saved["train_config"])
    elif settings.deferred:   # --resume auto starting fresh: the flags alone must make a valid run
        raise ConfigError(settings.deferred)
    elif opts.init_from:      # fine-tuning: the source's model and weights (capstone.gpt2.finetune)
        source, settings = _init_from(world, settings)
    elif settings.train.data and "vocab_size" not in settings.explicit:
        vocab = _agreed(world, lambda: load_meta(settings.train.data).vocab_size)
        settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, vocab_size=vocab))
    return path, saved, settings, source


def _check_memory(world: Comm, settings: Settings, plan: Plan) -> None:
    """Collective: ConfigError on every rank if a step of `plan` does not fit some node's memory."""
    train = settings.train.for_replicas(plan.replicas)
    batched = dataclasses.replace(train, batch_size=train.batch_for(plan.replicas))
    preflight.check_memory(world, settings.model, batched, plan)


def _checked(world: Comm, settings: Settings) -> tuple[Settings, Plan | None]:
    """(`settings`, their plan) if the flags make a layout the product runs (capstone.plan), else ConfigError;
    resuming, the flags' error waits (`deferred`, no plan): the checkpoint's modes may complete them (e.g.
    --pp-layers)."""
    try:
        return settings, Plan.make(model=settings.model, train=settings.train, world=world.size,
                                   given=settings.layout)[0]
    except ConfigError as exc:
        if settings.opts.resume is None:
            raise
        return dataclasses.replace(settings, deferred=settings.deferred or str(exc)), None


def _out_dir(opts: RunOptions) -> tuple[str, str | None]:
    """Rank 0: the run directory (--out; else the one --resume PATH belongs to: the run continues
    there; else a new runs/run-<time>-<pid>) and the note that says it continues in PATH's."""
    if opts.out:
        return opts.out, None
    if home := rundir.run_dir_of(opts.resume):
        return home, f"continuing in {home}, the run directory of --resume {opts.resume} (--out DIR branches off)"
    return time.strftime("runs/run-%Y%m%d-%H%M%S") + f"-{os.getpid()}", None


def _check_same_data(world: Comm, settings: Settings, saved: dict, path: str) -> None:
    """On --resume with --data: ConfigError unless it is the dataset the checkpoint trained on (by the digests
    it records, an older one's fewer: a moved copy is the same); the vocabulary's or layout's mismatch would
    name other flags. A checkpoint that records none trained on the synthetic corpus."""
    data = settings.train.data
    if "data" not in settings.explicit or not data:
        return
    recorded = saved.get("data") or {}
    had = {k: v for k, v in recorded.items() if k == "digest" or k.endswith("sha256") and "digest" not in recorded}
    given = _agreed(world, lambda: identity(load_meta(data)))
    if had and all(given.get(k) == v for k, v in had.items()):
        return
    was = saved["train_config"].get("data")
    do = (f"Pass --data {was} (or a moved copy of it) or leave --data out; to train those weights on {data}, "
          f"fine-tune instead: --init-from {path} --data {data} --out NEW_DIR.") if had else "Leave --data out."
    raise ConfigError(f"--data {data} is not the data {path} was trained on "
                      f"({f'the dataset {was}' if had else 'the synthetic corpus'}; the digests differ), and a resume "
                      f"continues on the same data. {do}")


def _init_from(world: Comm, settings: Settings):
    """--init-from on a fresh start: (the Source, the settings with its model), the new data's
    vocabulary checked against the source's (ConfigError/CheckpointError on every rank)."""
    from capstone.gpt2 import finetune
    source = finetune.fetch(world, settings.opts.init_from, settings.explicit.get("seq_len"))
    data = settings.train.data
    finetune.check_vocabulary(source, _agreed(world, lambda: identity(load_meta(data))) if data else {}, data)
    return source, finetune.settings_for(settings, source)


def build(world: Comm, settings: Settings, out: str, hooks: Hooks | None = None, plan: Plan | None = None) -> Run:
    """Collective: call on all ranks. Fresh objects on a new grid laid out by `plan` (None: the plan of
    the flags); the initial parameters are the 1-rank run's, made where the mode says (capstone.modes)."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    if plan is None:
        plan = Plan.make(model=mcfg, train=tcfg, world=world.size, given=settings.layout)[0]
    hooks, tcfg = _hooks(world, opts) if hooks is None else hooks, tcfg.for_replicas(plan.replicas)
    world.deadline.set_timeout(opts.collective_timeout)
    world.deadline.record_to(os.path.join(out, TIMEOUT_RECORD))   # for the batch script's watchdog
    grid = Grid.build(world, plan)
    batch = tcfg.batch_for(plan.replicas)
    data, data_identity = open_data(mcfg, tcfg, batch)
    identity = RunIdentity(mcfg, tcfg, data_identity, batch * tcfg.grad_accum * plan.replicas, plan.kept())
    p = modes.make(grid, plan, mcfg, tcfg, data, hooks, 1.0 / (identity.global_batch * mcfg.seq_len))
    cadence = Cadence(tcfg, world.rank, opts.stop_after)
    ckpt = Checkpointer(world, os.path.join(out, "checkpoints"), p.full, identity, cadence, p.view, hooks,
                        background.writer(world) if plan.ckpt_async else None)
    state = RunState()
    guard = Guard(tcfg.spike_factor, tcfg.max_rollbacks, state.guard, plan.guard_undo)
    return Run(grid=grid, plan=plan, mcfg=mcfg, tcfg=tcfg, opts=opts, out=out, model=p.model, opt=p.opt, reducer=p.reducer,
               schedule=p.schedule, data=p.data, heldout=p.heldout, guard=guard, cadence=cadence, ckpt=ckpt, state=state,
               replicas=p.replicas, hooks=hooks, batch_size=batch, global_batch=identity.global_batch,
               n_params=p.full.n_params)


def _hooks(world: Comm, opts: RunOptions) -> Hooks:
    """The test seam: fault injection when a test asks for it (capstone.runtime.faults), else nothing."""
    hooks = Hooks()
    faults = (opts.inject_lr_spike, opts.inject_nan, opts.sleep_per_step, opts.inject_grad_sign, opts.inject_no_update)
    if os.environ.get("CAPSTONE_FAULT") or os.environ.get("CAPSTONE_FAULT_PIDS") or any(faults):
        from capstone.runtime.faults import Faults
        hooks = Faults(world.rank, *faults)
    world.hooks = hooks   # every collective is a hook point (capstone.collective.comm)
    return hooks


def start(run: Run, path: str | None = None, saved_train: dict | None = None, why: dict | None = None) -> None:
    """Collective: call on all ranks. Restore checkpoint `path` (None: measure the starting loss
    of a fresh run), then open metrics.jsonl. `why`: the kept modes that fell back, and why."""
    world = run.grid.world
    if path is not None:
        _resume(run, path, saved_train if saved_train is not None else dataclasses.asdict(run.tcfg), why or {})
    else:
        run.state.eval_start = run.state.best_eval = run.guard.state.last_eval = run.heldout.measure()
    if world.rank == 0:
        os.makedirs(run.out, exist_ok=True)
    run.ckpt.provenance = provenance.collect(world)   # into summary.json and every checkpoint's metadata
    if run.init_from is not None:
        run.ckpt.provenance["init_from"] = run.init_from
    run.metrics = report.MetricsLog(os.path.join(run.out, "metrics.jsonl") if world.rank == 0 else None)
    run.metrics.write({"event": "start", "run_id": run.state.run_id, "world": world.size, "grid": run.grid.describe(),
                       "start_step": run.state.step, "resumed_from": run.resumed_from, "time": time.time(),
                       "provenance": run.ckpt.provenance, "train_config": dataclasses.asdict(run.tcfg),
                       "model_config": dataclasses.asdict(run.mcfg), "modes": run.plan.kept()})


def _agreed(world: Comm, read):
    """Rank 0 runs `read()`; its value, or its ConfigError/CheckpointError, reaches every rank."""
    return agreed(world, read, errors=(ConfigError, checkpoint.CheckpointError))


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


def _resume(run: Run, path: str, saved: dict, why: dict) -> None:
    while True:   # a stop's checkpoint the guard rejects on load: the newest older one (capstone.checkpoint.judge)
        shard, state, meta = run.ckpt.load(path)
        run.opt.load_state(shard)
        run.guard.state = state.guard
        reason, held = judge.verdict(run, meta)
        if reason is None:
            break
        path = judge.fall_back(run, path, reason, held)
    state.run_id = state.run_id or run.state.run_id   # a checkpoint from before run ids: this one from now on
    path = str(path)   # a recover.Found: "node memory (step S)"
    run.state, run.resumed_from = state, path
    run.ckpt.last_judged = path if os.path.dirname(os.path.abspath(path)) == os.path.abspath(run.ckpt.directory) else None
    run.init_from = (meta.get("provenance") or {}).get("init_from")
    run.segment_start = (state.guard.last_eval, state.best_eval)
    if state.step >= run.tcfg.steps:
        if run.opts.resume == "auto":   # a requeued batch job whose work is done
            raise RunFinished(f"{path} is at step {state.step}, the last of --steps {run.tcfg.steps}: the run is "
                              f"finished, nothing to do (summary.json and metrics.jsonl are as they were). Pass "
                              f"--steps larger than {state.step} to train on.")
        raise ConfigError(f"{path} is at step {state.step} and --steps is {run.tcfg.steps}: nothing left to do. "
                          f"Pass --steps larger than {state.step} to train on.")
    if 0 < run.opts.stop_after <= state.step and run.opts.resume != "auto":   # auto: a requeue after that stop
        raise ConfigError(f"--stop-after {run.opts.stop_after} is not after {path}'s step {state.step}, so the run "
                          f"would never stop there and would train on to --steps {run.tcfg.steps}. Pass --stop-after "
                          f"larger than {state.step}, or leave it out to train to the end.")
    changed = {k: (v, getattr(run.tcfg, k)) for k, v in saved.items() if getattr(run.tcfg, k, v) != v}
    if meta.get("global_batch", run.global_batch) != run.global_batch:   # batch_size x grad_accum x replicas
        changed["global batch (sequences per step)"] = (meta["global_batch"], run.global_batch)
    changed.update(kept.changes(meta.get("modes"), run.plan, why))
    if run.tcfg.deterministic and "det_split" not in (meta.get("modes") or {}) and run.grid.world.rank == 0:
        report.say("note: the checkpoint's run logged fingerprints of the older kind (sha256 of each rank's part of the "
                   "parameters); from this resume they are of the canonical vector's chunks (docs/deterministic.md)")
    report.resumed(path, state, meta["world_size"], run.grid.world.size, changed,
                   -1 if run.opts.quiet else run.grid.world.rank)   # --quiet: the final line only
