"""`Run`: the objects of one training run, built from the configs, started fresh or resumed.

Each piece of state has one owner: `Model` the parameter and gradient buffers, `ZeroAdam` the
optimizer shard, `Guard` the last good shard, `Checkpointer` what was saved, `RunState` the
progress that a checkpoint restores, `ReplicaCheck` invariant (b)'s record.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

from . import checkpoint, faults, preflight, report, resume
from .checkpoint import files
from .checkpointer import Checkpointer
from .cli import RunOptions
from .config import ConfigError, ModelConfig, TrainConfig
from .data import DataStream, synthetic
from .dist import Dist
from .guard import Guard
from .invariants import ReplicaCheck
from .model import Model
from .params import Layout, init_params
from .runstate import RunIdentity, RunState
from .zero import ROWS, ZeroAdam


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
    guard: Guard
    ckpt: Checkpointer
    state: RunState
    replicas: ReplicaCheck
    faults: faults.Injections
    metrics: report.MetricsLog | None = None
    resumed_from: str | None = None

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over all ranks and micro-batches."""
        return self.tcfg.batch_size * self.tcfg.grad_accum * self.dist.world

    def eval_loss_share(self) -> float:
        """This rank's share of the held-out loss (summed over ranks it is the mean per token)."""
        x, y = self.data.eval_batch(self.dist.rank, self.dist.world)
        if len(x) == 0:
            return 0.0
        return self.model.loss(x, y, 1.0 / (self.data.eval_sequences * self.mcfg.seq_len))

    def memory_row(self) -> dict:
        return {"rank": self.dist.rank, "params_bytes": self.model.params.nbytes,
                "grads_bytes": self.model.grads.nbytes + self.opt.g_shard.nbytes,
                "optimizer_bytes": self.opt.optimizer_nbytes(), "guard_bytes": self.guard.nbytes(),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def build(dist: Dist, mcfg: ModelConfig, tcfg: TrainConfig, opts: RunOptions) -> Run:
    """Collective: call on all ranks. Fresh objects; rank 0's initial parameters are broadcast."""
    layout = Layout.for_model(mcfg, dist.world)
    params = init_params(layout, mcfg, tcfg.seed) if dist.rank == 0 else layout.zeros()
    model = Model(mcfg, layout, params)
    opt = ZeroAdam(dist.comm, layout, model.params, model.grads, (tcfg.beta1, tcfg.beta2), tcfg.eps, tcfg.weight_decay)
    data = synthetic(mcfg, tcfg)
    out = dist.bcast_json(opts.out or time.strftime("runs/run-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    identity = RunIdentity(mcfg, tcfg, data.identity, tcfg.batch_size * tcfg.grad_accum * dist.world)
    ckpt = Checkpointer(dist, os.path.join(out, "checkpoints"), layout, identity)
    state = RunState()
    guard = Guard(tcfg.spike_factor, tcfg.max_rollbacks, state.guard)
    return Run(dist, mcfg, tcfg, opts, out, model, opt, data, guard, ckpt, state, ReplicaCheck(),
               faults.Injections(opts.inject_lr_spike, opts.inject_nan))


def start(run: Run) -> None:
    """Collective: call on all ranks. Check the I/O stack and the memory a step needs, claim the
    run directory (create, lock, probe, free space: `preflight`), resume if asked. A failed start
    raises on every rank and leaves nothing behind that it created."""
    _check_parallel_io(run.dist)
    preflight.check_memory(run.dist, run.mcfg, run.tcfg)
    ckpt_bytes = files.estimated_size(run.model.layout.padded * len(ROWS) * 4, run.dist.world)
    claim = preflight.claim(run.dist, run.out, run.ckpt.directory, ckpt_bytes)
    try:
        path = resume.resolve(run.dist, run.opts.resume, run.ckpt.directory)
        if path is not None:
            _resume(run, path)
    except (ConfigError, checkpoint.CheckpointError):
        if run.dist.rank == 0:
            claim.undo()
        raise
    if path is None:
        run.state.eval_start = run.dist.allreduce_sum([run.eval_loss_share()])[0]
        run.guard.state.last_eval = run.state.eval_start
    run.metrics = report.MetricsLog(os.path.join(run.out, "metrics.jsonl") if run.dist.rank == 0 else None)
    run.metrics.write({"event": "start", "world": run.dist.world, "start_step": run.state.step,
                       "resumed_from": run.resumed_from, "time": time.time()})


def _check_parallel_io(dist: Dist) -> None:
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


def _resume(run: Run, path: str) -> None:
    shard, state, meta = run.ckpt.load(path)
    run.opt.load_state(shard)
    run.guard.state = state.guard
    run.state, run.resumed_from = state, path
    if state.step >= run.tcfg.steps:
        raise ConfigError(f"{path} is at step {state.step} and --steps is {run.tcfg.steps}: nothing left to do. "
                          f"Pass --steps larger than {state.step} to train on.")
    saved = meta["train_config"]
    changed = {k: (v, getattr(run.tcfg, k)) for k, v in saved.items() if getattr(run.tcfg, k, v) != v}
    report.resumed(path, state, meta["world_size"], run.dist.world, changed, run.dist.rank)
