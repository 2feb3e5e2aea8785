"""`python -m capstone.train`: the training loop, top to bottom.

`train_step` is one optimizer step in the product's order (docs/design.md, "The picture"); `train` adds the
checkpoints and the log, `finish` the four invariants. The loop calls `Run`'s narrow interfaces only, never MPI
or HDF5, the same for every grid, reducer and mode: those are chosen once, when the run is built (capstone.run).
"""

from capstone.runtime import signals

if __name__ == "__main__":   # before NumPy and MPI load (seconds under mpirun): a stop asked for meanwhile
    signals.install()        # is kept, where SIGUSR1's default action would kill the rank

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from capstone import checkpoint, cli
from capstone.checkpoint import best, judge
from capstone.checkpoint.cadence import Due
from capstone.config import ConfigError
from capstone.step.guard import DivergenceError
from capstone.observe import invariants, memory, outcome, report, verdict
from capstone.collective import launch
from capstone.parallel.reduce import Flags
from capstone.run import Run, open_run
from capstone.runtime import heap, margin, stop


class PhaseTimer:
    """Milliseconds per phase of a step (`with timer("fwd_bwd"): ...`), timed outside its logic as in torchtitan."""

    def __init__(self):
        self.t0, self.ms = time.perf_counter(), {}

    @contextmanager
    def __call__(self, phase: str):
        t = time.perf_counter()
        yield
        self.ms[phase] = self.ms.get(phase, 0.0) + 1e3 * (time.perf_counter() - t)

    def total_ms(self) -> float:
        return 1e3 * (time.perf_counter() - self.t0)


@dataclass
class StepResult:
    """What one step did: its numbers for the log, and what the ranks agreed it must do."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    samples: tuple[int, int]
    due: Due
    eval_loss: float | None = None            # held-out loss after the update (None: not measured)
    grad_norm_clipped: float | None = None
    rollback: str | None = None               # the guard's reason, if the step was not kept
    updated: bool = False                     # an update was applied (kept or undone)
    param_norm: float = 0.0
    fingerprint: str = ""
    events: list = field(default_factory=list)
    ms: dict = field(default_factory=dict)    # phase -> milliseconds (PhaseTimer)
    traffic: dict = field(default_factory=dict)   # collective kind -> Traffic (capstone.collective.comm)


def train_step(run: Run, s: int, writing: bool = False) -> StepResult:
    """Collective: one optimizer step (`writing`: this rank's background checkpoint write still runs)."""
    timer, state, tcfg = PhaseTimer(), run.state, run.tcfg
    run.grid.world.begin_step(s)
    run.hooks.at("step", s)
    with timer("fwd_bwd"), np.errstate(over="ignore", invalid="ignore"):   # a diverging step is the guard's
        batches = [run.data.micro_batch(state.cursor, j, run.grid.dp.rank, run.grid.dp.size)
                   for j in range(tcfg.grad_accum)]
        losses = run.schedule.forward_backward(batches, s)
    with timer("reduce"):
        stats = run.reducer.finish(losses, Flags(stop.requested(), run.cadence.clock_due(), writing))
    r = StepResult(s, stats.loss, stats.norm, run.hooks.learning_rate(s, tcfg.lr_at(s)),
                   (state.cursor, state.cursor + run.global_batch), run.cadence.due(s, stats.flags))
    if r.due.abandon:   # a signal: this step stops here, its update never applied (`save_on_stop`)
        return r
    r.rollback = run.guard.batch_verdict(r.loss, r.grad_norm)                         # guard: the batch
    if r.rollback is None:
        with timer("optimizer"), np.errstate(over="ignore", invalid="ignore"):        # judged just below
            r.grad_norm_clipped = run.opt.apply(run.reducer.grad_shard, r.lr, r.grad_norm)   # ZeRO update
        with timer("eval"):
            r.eval_loss, finite = run.heldout.after_update(run.opt.finite(), r.due.evaluate)
        r.updated, r.rollback = True, run.guard.update_verdict(r.eval_loss, finite)  # guard: the update
    if r.rollback is None:
        run.guard.accept(r.loss, r.eval_loss)
        state.accepted(s, r.loss, r.eval_loss)
    else:
        roll_back(run, r)
    state.cursor += run.global_batch
    run.hooks.parameters(s, run.model.params)
    with timer("checks"):                                                             # invariant (b)
        r.param_norm, r.fingerprint = run.replicas.check(s, run.model.params, strong=r.due.evaluate)
    r.ms, r.traffic = {"step": timer.total_ms(), **timer.ms}, run.grid.world.step_traffic()
    return r


def roll_back(run: Run, r: StepResult) -> None:
    """Skip this batch; undo its update if one was applied (the same decision on every rank)."""
    undo = run.guard.undoes(r.rollback)
    run.guard.triggered(r.step, r.rollback)
    if undo:
        run.opt.revert()
    event = {"event": "rollback", "reason": r.rollback, "step": r.step, "loss": report.jsonable(r.loss),
             "eval_loss": report.jsonable(r.eval_loss), "restored_adam_t": run.opt.state.t,
             "skipped_samples": list(r.samples)}
    r.events.append(event)
    run.state.rollbacks.append(event)
    report.rolled_back(r, run.guard.state, run.opt.state.t, run.grid.world.rank)


def train(run: Run) -> int:
    """Collective: call on all ranks. Train to the last step or a stop request; returns the exit code."""
    t_start, status, rows, start_step = time.perf_counter(), "completed", [], run.state.step
    log, fit = report.StepLog(run, start_step), margin.StopMargin(run, start_step)   # does a stop fit mpirun's kill?
    with outcome.recorded(run, start_step, t_start, log):   # summary.json also on a guard's abort or a timeout
        while run.state.step < run.tcfg.steps:
            run.state.step += 1
            r = train_step(run, run.state.step, run.ckpt.writing())
            if not r.due.writing:   # every rank's background write has ended: a failed one ends the run now
                run.ckpt.drain()
            if r.due.abandon:   # a signal: the step's update was never applied, nothing of it is logged
                judge.save_on_stop(run, r.step)
            else:
                if r.due.checkpoint:
                    r.events.append({"event": "checkpoint", "path": run.ckpt.save(run.state, run.opt.state)["path"]})
                run.ckpt.remember(run.state, run.opt.state)   # --memory-tier: the step in the nodes' memory
                best.keep(run, r)   # --keep-best
                rows.append(log.step(r))
                run.hooks.step_done(r.step)
                fit.step_done(r.step, r.due.stop)
            if r.due.abandon or r.due.stop:   # (an abandoned step is not run.state.step: save_on_stop took it back)
                status = "preempted"
                report.stopped(run, run.state.step, stop.reason())
                break
    log.close()
    run.ckpt.forget()   # a run that ends here (the last step, a stop) has its last state on disk
    return finish(run, status, rows, start_step, time.perf_counter() - t_start)


def finish(run: Run, status: str, rows: list, start_step: int, wall: float) -> int:
    """Collective: call on all ranks. The four invariants, the report, summary.json; the exit code."""
    verified = run.ckpt.verify_first()
    mem = run.grid.world.allgather_json(memory.row(run))
    results = {
        "a_loss_monotone": invariants.of_segment(run.state, run.tcfg, start_step, run.segment_start,
                                                 status == "preempted", run.init_from is not None),
        "b_params_identical": invariants.params_identical(run.replicas.mismatches, run.replicas.checked,
                                                          run.state.step - start_step),
        "c_memory": invariants.memory(mem, run.grid.dp.size),
        "d_resume_bytes": invariants.resume_bytes(verified, status == "preempted" and run.state.step == start_step)}
    failed = verdict.failures(results)
    summary = report.Summary(status if not failed else "failed", run, rows, start_step, results, mem, wall,
                             run.final_fingerprint())
    report.final(summary, verified, failed, run.grid.world.rank)
    if run.grid.world.rank == 0:
        report.write_json(os.path.join(run.out, "summary.json"), summary.to_json())
    run.metrics.close()
    return 1 if failed else 0


def main(argv=None) -> None:
    signals.install()
    world = launch.world()
    settings = cli.parse_on_every_rank(argv, world.rank)
    heap.keep_freed_memory()
    with launch.fail_fast(world):
        try:
            run = open_run(world, settings)   # None: --resume auto found the run finished (exit 0)
            code = train(run) if run is not None else 0
        except (ConfigError, checkpoint.CheckpointError, DivergenceError) as exc:  # raised on every rank alike
            if world.rank == 0:
                report.error(f"error: {exc}")
            code = 1 if not isinstance(exc, ConfigError) else 2
    sys.exit(code)


if __name__ == "__main__":
    main()
