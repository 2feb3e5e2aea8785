"""`Run`: the objects of one training run, built from the configs, started fresh or resumed.

Each piece of state has one owner: `Model` the parameter and gradient buffers, `ZeroAdam` the
optimizer shard, `Guard` the last good shard, `Checkpointer` what was saved, `RunState` the
progress that a checkpoint restores, `ReplicaCheck` invariant (b)'s record.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from dataclasses import dataclass

from capstone import checkpoint, faults
from capstone.parallel import deterministic
from capstone.runtime import preflight
from capstone.observe import provenance, report
from capstone.checkpoint import resume
from capstone.parallel import tensor as tensor_parallel
from capstone.checkpoint import files
from capstone.checkpoint.saver import Checkpointer
from capstone.cli import RunOptions, Settings
from capstone.config import ConfigError, ModelConfig, TrainConfig
from capstone.data.synthetic import DataStream, open_data
from capstone.parallel.dist import Dist
from capstone.data.heldout import HeldOut
from capstone.parallel.grid import Grid
from capstone.guard import Guard
from capstone.invariants import ReplicaCheck
from capstone.model.gpt import Model
from capstone.model.params import Layout, init_params
from capstone.state import RunIdentity, RunState
from capstone.data.tokens import load_meta
from capstone.parallel.zero import ROWS, ZeroAdam

TIMEOUT_RECORD = "collective-timeout.json"   # in the run directory, written by a rank whose collective timed out


@dataclass
class Run:
    """Everything one run holds (see the module docstring for who owns what)."""

    dist: Dist
    mcfg: ModelConfig
    tcfg: TrainConfig
    opts: RunOptions
    out: str
    model: Model
    opt: ZeroAdam
    data: DataStream
    heldout: HeldOut
    guard: Guard
    ckpt: Checkpointer
    state: RunState
    replicas: ReplicaCheck
    faults: faults.Injections
    batch_size: int                        # sequences per rank per micro-batch
    metrics: report.MetricsLog | None = None
    segment_start: tuple = (None, None)    # (held-out loss, best held-out loss) where this segment began
    resumed_from: str | None = None
    det: deterministic.Reducer | None = None   # --deterministic: replaces forward_backward + reduce_gradients
    grid: Grid | None = None                   # the (dp x tp) process grid; None: plain data parallelism

    @property
    def dp_rank(self) -> int:
        """This rank's replica index: the data stream is indexed by it (TP ranks of a replica see the same samples)."""
        return self.dist.rank if self.grid is None else self.grid.dp_rank

    @property
    def dp_world(self) -> int:
        """Data-parallel replicas (the world size without tensor parallelism)."""
        return self.dist.world if self.grid is None else self.grid.dp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over all ranks and micro-batches."""
        return self.batch_size * self.tcfg.grad_accum * self.dp_world

    def eval_due(self, step: int, checkpoint_due: bool) -> bool:
        """Evaluation steps: every eval_every steps, every checkpoint, the last step."""
        return step % self.tcfg.eval_every == 0 or checkpoint_due or step == self.tcfg.steps

    def memory_row(self) -> dict:
        return {"rank": self.dist.rank, "params_bytes": self.model.params.nbytes,
                "grads_bytes": self.model.grads.nbytes + self.opt.g_shard.nbytes,
                "optimizer_bytes": self.opt.optimizer_nbytes(), "guard_bytes": self.opt.before_nbytes(),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def open_run(dist: Dist, settings: Settings) -> Run:
    """Collective: call on all ranks. Decide fresh or resumed (the checkpoint's settings under the
    explicit flags), build every piece, restore the checkpoint or measure the starting loss."""
    opts = settings.opts
    out = dist.bcast_json(opts.out or time.strftime("runs/run-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    ckpt_dir = os.path.join(out, "checkpoints")
    check_parallel_io(dist)
    grid = Grid.build(dist.comm, opts.tp, settings.model, settings.train)   # bad --tp: ConfigError, nothing written
    padded = Layout.for_model(settings.model, dist.world).padded
    claim = preflight.claim(dist, out, ckpt_dir, files.estimated_size(padded * len(ROWS) * 4, dist.world))
    try:  # a failed start leaves nothing behind that it created
        path = resume.resolve(dist, opts.resume, ckpt_dir)
        if path is not None:
            saved = _agreed(dist, lambda: checkpoint.read_meta_file(path))
            settings = settings.on_top_of(saved["model_config"], saved["train_config"])
        elif settings.train.data and "vocab_size" not in settings.explicit:
            vocab = _agreed(dist, lambda: load_meta(settings.train.data).vocab_size)
            settings = dataclasses.replace(settings, model=dataclasses.replace(settings.model, vocab_size=vocab))
        tcfg = settings.train
        preflight.check_memory(dist, settings.model, dataclasses.replace(tcfg, batch_size=tcfg.batch_for(grid.dp)))
        run = build(dist, settings, out, grid)
        start(run, path, saved["train_config"] if path is not None else None)
    except (ConfigError, checkpoint.CheckpointError):
        if dist.rank == 0:
            claim.undo()
        raise
    return run


def start(run: Run, path: str | None = None, saved_train: dict | None = None) -> None:
    """Collective: call on all ranks. Restore checkpoint `path` (None: measure the starting loss
    of a fresh run), then open metrics.jsonl."""
    if path is not None:
        _resume(run, path, saved_train if saved_train is not None else dataclasses.asdict(run.tcfg))
    else:
        run.state.eval_start = run.state.best_eval = run.dist.allreduce_sum([run.heldout.loss_share(run.model)])[0]
        run.guard.state.last_eval = run.state.eval_start
    if run.dist.rank == 0:
        os.makedirs(run.out, exist_ok=True)
    run.ckpt.provenance = provenance.collect(run.dist)   # into summary.json and every checkpoint's metadata
    run.metrics = report.MetricsLog(os.path.join(run.out, "metrics.jsonl") if run.dist.rank == 0 else None)
    run.metrics.write({"event": "start", "world": run.dist.world, "start_step": run.state.step,
                       "resumed_from": run.resumed_from, "time": time.time(), "provenance": run.ckpt.provenance,
                       "train_config": dataclasses.asdict(run.tcfg), "model_config": dataclasses.asdict(run.mcfg)})


def _agreed(dist: Dist, read):
    """Rank 0 runs `read()`; its value, or its ConfigError/CheckpointError, reaches every rank."""
    if dist.rank == 0:
        try:
            value = {"value": read()}
        except (ConfigError, checkpoint.CheckpointError) as exc:
            value = {"error": str(exc), "config": isinstance(exc, ConfigError)}
    got = dist.bcast_json(value if dist.rank == 0 else None)
    if "error" in got:
        raise (ConfigError if got["config"] else checkpoint.CheckpointError)(got["error"])
    return got["value"]


def build(dist: Dist, settings: Settings, out: str, grid: Grid | None = None) -> Run:
    """Collective: call on all ranks. Fresh objects; rank 0's initial parameters are broadcast."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    dist.deadline.set_timeout(opts.collective_timeout)
    dist.deadline.record_to(os.path.join(out, TIMEOUT_RECORD))   # for the batch script's watchdog
    if grid is not None and grid.tp > 1:  # --tp K: the TP-slice pieces (capstone/tp.py)
        return _build_tp(dist, settings, out, grid)
    batch = tcfg.batch_for(dist.world)
    layout = Layout.for_model(mcfg, dist.world)
    params = init_params(layout, mcfg, tcfg.seed) if dist.rank == 0 else layout.zeros()
    model = Model(mcfg, layout, params)
    opt = ZeroAdam(dist.comm, layout, model.params, model.grads, (tcfg.beta1, tcfg.beta2), tcfg.eps, tcfg.weight_decay,
                   deadline=dist.deadline, bucket_floats=int(opts.bucket_mb * 2**20) // 4 if opts.overlap else 0)
    data, data_identity = open_data(mcfg, tcfg, batch)
    heldout = HeldOut(data, tcfg.eval_batches, tcfg.eval_batch_size, mcfg.seq_len, dist.rank, dist.world)
    if tcfg.deterministic:  # --deterministic: fixed eval blocks and the fixed-order gradient reduction
        heldout = deterministic.HeldOutBlocks(data, tcfg.eval_batches, tcfg.eval_batch_size, mcfg.seq_len, dist.comm)
    identity = RunIdentity(mcfg, tcfg, data_identity, batch * tcfg.grad_accum * dist.world)
    ckpt = Checkpointer(dist, os.path.join(out, "checkpoints"), layout, identity)
    state = RunState()
    guard = Guard(tcfg.spike_factor, tcfg.max_rollbacks, state.guard)
    return Run(dist, mcfg, tcfg, opts, out, model, opt, data, heldout, guard, ckpt, state, ReplicaCheck(),
               faults.Injections(opts.inject_lr_spike, opts.inject_nan), batch,
               det=deterministic.Reducer(dist.comm, model, opt, tcfg.grad_accum) if tcfg.deterministic else None,
               grid=grid)


def _build_tp(dist: Dist, settings: Settings, out: str, grid: Grid) -> Run:
    """build() for --tp K > 1: model, optimizer, held-out set and checkpointer of this rank's TP slice."""
    mcfg, tcfg, opts = settings.model, settings.train, settings.opts
    from capstone.parallel.grid import check
    check(grid.tp, dist.world, mcfg, tcfg)   # again: a resume may have brought the checkpoint's model config
    batch = tcfg.batch_for(grid.dp)
    data, data_identity = open_data(mcfg, tcfg, batch)
    identity = RunIdentity(mcfg, tcfg, data_identity, batch * tcfg.grad_accum * grid.dp)
    _, model, opt, heldout, ckpt = tensor_parallel.build_parts(dist, grid, mcfg, tcfg, data, identity,
                                                               os.path.join(out, "checkpoints"))
    state = RunState()
    guard = Guard(tcfg.spike_factor, tcfg.max_rollbacks, state.guard)
    return Run(dist, mcfg, tcfg, opts, out, model, opt, data, heldout, guard, ckpt, state, ReplicaCheck(),
               faults.Injections(opts.inject_lr_spike, opts.inject_nan), batch, grid=grid)


def check_parallel_io(dist: Dist) -> None:
    if checkpoint.mpi_io_available():
        return
    if dist.world == 1:
        report.say("note: h5py has no MPI support; one rank writes the same checkpoint format with serial "
                   "h5py. More ranks need h5py built against parallel HDF5 (scripts/setup).", dist.rank)
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
    run.segment_start = (state.guard.last_eval, state.best_eval)
    if state.step >= run.tcfg.steps:
        raise ConfigError(f"{path} is at step {state.step} and --steps is {run.tcfg.steps}: nothing left to do. "
                          f"Pass --steps larger than {state.step} to train on.")
    changed = {k: (v, getattr(run.tcfg, k)) for k, v in saved.items() if getattr(run.tcfg, k, v) != v}
    report.resumed(path, state, meta["world_size"], run.dist.world, changed, run.dist.rank)
