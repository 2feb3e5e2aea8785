"""`python -m capstone.train`: the training loop, top to bottom.

`train_step` is one optimizer step in the order of the product: data, forward+backward, the
ZeRO-1 gradient reduce, the guard's verdict on the batch, the update and its verdict, the
replica check. `train` adds the checkpoints and the log; `finish` checks the four invariants.
The loop calls narrow interfaces only (`Run`'s objects, `Dist`); it never touches MPI or HDF5.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from capstone.observe import accounting, report, tensorboard
from capstone import checkpoint, cli, faults, invariants
from capstone.parallel import deterministic
from capstone.runtime import heap, stop
from capstone.config import ConfigError
from capstone.parallel.dist import Dist, fail_fast
from capstone.guard import DivergenceError
from capstone.model.params import fingerprint
from capstone.run import Run, open_run
from capstone.schedule import learning_rate


@dataclass
class StepResult:
    """What one step did: its numbers for the log, and whether the ranks agreed to stop or save."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    samples: tuple[int, int]
    eval_loss: float | None = None            # held-out loss after the update (None: no update ran)
    grad_norm_clipped: float | None = None
    rollback: str | None = None               # the guard's reason, if the step was not kept
    updated: bool = False                     # an update was applied (kept or undone)
    ms: dict = field(default_factory=dict)    # phase -> milliseconds
    param_norm: float = 0.0
    fingerprint: str = ""
    events: list = field(default_factory=list)
    stop: bool = False                        # a stop was requested on some rank
    clock_due: bool = False                   # rank 0's wall-clock checkpoint interval has passed
    tp_comm: object = None                    # --tp: the f/g allreduces of the step (tp.TPComm)


def train_step(run: Run, s: int) -> StepResult:
    """Collective: call on all ranks. One optimizer step; returns what happened."""
    dist, model, opt, guard, state = run.dist, run.model, run.opt, run.guard, run.state
    t0 = time.perf_counter()
    faults.point("raise_in_step", dist.rank, s)
    faults.point("stall", dist.rank, s)                                               # test fault: a silent rank
    opt.begin_step(s, run.tcfg.grad_accum)                                            # collective timeout; overlap
    batches = [run.data.micro_batch(state.cursor, j, run.dp_rank, run.dp_world)      # data (by replica)
               for j in range(run.tcfg.grad_accum)]
    if run.det is not None:  # --deterministic: per-block gradients, fixed-order reductions (deterministic.py)
        with np.errstate(over="ignore", invalid="ignore"):
            stats = run.det.step(batches, 1.0 / (run.global_batch * run.mcfg.seq_len),
                                 [stop.requested(), dist.rank == 0 and run.ckpt.clock_due()],
                                 lambda g: run.faults.poison(s, dist.rank, g))
        t1 = time.perf_counter() - opt.timings["reduce_scatter"]                      # fwd_bwd_ms: the compute
        t_reduce = opt.timings["reduce_scatter"]
    else:
        with np.errstate(over="ignore", invalid="ignore"):                            # a diverging step is the guard's
            local = model.forward_backward(batches, 1.0 / (run.global_batch * run.mcfg.seq_len))
        run.faults.poison(s, dist.rank, model.grads)
        t1 = time.perf_counter()
        stats = opt.reduce_gradients(extras=[local, stop.requested(), dist.rank == 0 and run.ckpt.clock_due()])
        t_reduce = time.perf_counter() - t1
    t_eval, t_allreduce = 0.0, 0.0                                                    # observability timings
    lr = run.faults.lr_mult(s) * learning_rate(s, run.tcfg.lr, run.tcfg.steps, run.tcfg.lr_schedule,
                                               run.tcfg.warmup_steps, run.tcfg.min_lr)
    r = StepResult(s, float(stats.extras[0]), stats.norm, lr, (state.cursor, state.cursor + run.global_batch),
                   stop=stats.extras[1] > 0, clock_due=stats.extras[2] > 0)
    evaluate = run.eval_due(s, run.ckpt.due(s, r.clock_due, r.stop or s == run.opts.stop_after, s == run.tcfg.steps))
    r.rollback = guard.batch_verdict(r.loss, r.grad_norm)                             # guard: the batch
    if r.rollback is None:
        if run.faults.lr_mult(s) != 1.0:
            r.events.append({"event": "lr_spike_injected", "mult": run.faults.lr_mult(s)})
        clip = run.tcfg.clip if 0 < run.tcfg.clip < r.grad_norm else 0.0
        r.grad_norm_clipped = clip or r.grad_norm
        with np.errstate(over="ignore", invalid="ignore"):                            # judged just below
            opt.apply(lr, clip / r.grad_norm if clip else 1.0)                         # ZeRO-1 update
            t_eval = time.perf_counter()
            eval_local = run.heldout.loss_share(model) if evaluate else 0.0
            t_eval = time.perf_counter() - t_eval
        t_allreduce = time.perf_counter()
        eval_loss, nonfinite = dist.allreduce_sum([eval_local, float(not opt.state.finite())])
        t_allreduce = time.perf_counter() - t_allreduce
        r.eval_loss, r.updated = eval_loss if evaluate else None, True
        r.rollback = guard.update_verdict(r.eval_loss, nonfinite == 0)                 # guard: the update
    if r.rollback is None:
        guard.accept(r.loss, r.eval_loss)
        state.accepted(s, r.loss, r.eval_loss)
    else:
        roll_back(run, r)
    state.cursor += run.global_batch
    faults.flip_param_bit(dist.rank, s, model.params)                                 # test fault: (b)
    r.param_norm, r.fingerprint = (fingerprint(model.params, evaluate) if run.det is None  # invariant (b)
                                   else deterministic.fingerprint(model.params, model.layout.n_params))
    every = dist.allgather_json([r.param_norm, r.fingerprint])
    run.replicas.record(s, every if run.grid is None else run.grid.by_slice(every))  # --tp: per TP slice
    t2 = time.perf_counter()
    applied = float(r.updated)  # an update ran (kept or undone)
    tm = opt.timings
    r.ms = {"step_ms": 1e3 * (t2 - t0), "fwd_bwd_ms": 1e3 * (t1 - t0),
            "comm_ms": 1e3 * (tm["reduce_scatter"] + applied * tm["allgather"]),
            "reduce_scatter_ms": 1e3 * tm["reduce_scatter"], "allgather_ms": 1e3 * applied * tm["allgather"],
            "optimizer_ms": 1e3 * applied * tm["adam"], "eval_ms": 1e3 * t_eval * evaluate,
            "allreduce_stats_ms": 1e3 * (t_reduce - tm["reduce_scatter"]), "allreduce_eval_ms": 1e3 * t_allreduce}
    if run.grid is not None and run.grid.tp > 1:  # --tp: the f/g allreduces inside fwd_bwd_ms
        r.ms["tp_allreduce_ms"] = 1e3 * model.tp_comm.seconds
        r.tp_comm = model.tp_comm
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
    report.rolled_back(r, run.guard.state, run.opt.state.t, run.dist.rank)


def train(run: Run) -> int:
    """Collective: call on all ranks. Train to the last step or a stop request; returns the exit code."""
    t_start, status, rows = time.perf_counter(), "completed", []
    start_step = run.state.step
    console = report.Console(report.log_every(run.opts.log_every, run.tcfg.steps), run.tcfg.steps, start_step)
    board = tensorboard.open_board(run.dist, run.opts.tensorboard) if run.opts.tensorboard else None
    report.banner(run, console.header())
    while run.state.step < run.tcfg.steps:
        run.state.step += 1
        r = train_step(run, run.state.step)
        stopping = r.stop or r.step == run.opts.stop_after
        if run.ckpt.due(r.step, r.clock_due, stopping, r.step == run.tcfg.steps):
            man = run.ckpt.save(run.state, run.opt.state)
            r.events.append({"event": "checkpoint", "path": man["path"]})
        row = report.metrics_row(r, run.global_batch * run.mcfg.seq_len, run.state.cursor * run.mcfg.seq_len,
                                 accounting.step_comm(r.ms, run.model.layout.padded, run.dp_world, r.tp_comm),
                                 repeat=r.step <= run.metrics.last_step)
        run.metrics.write(row)
        rows.append(row)
        if board is not None:
            board.write(row)
        line = console.line(row)
        if line is not None and not run.opts.quiet:
            report.say(line, run.dist.rank)
        if run.opts.sleep_per_step:
            time.sleep(run.opts.sleep_per_step)
        if stopping and r.step < run.tcfg.steps:
            status = "preempted"
            report.stopped(run, r.step, stop.reason())
            break
    if board is not None:
        board.close()
    return finish(run, status, rows, start_step, time.perf_counter() - t_start)


def finish(run: Run, status: str, rows: list, start_step: int, wall: float) -> int:
    """Collective: call on all ranks. The four invariants, the report, summary.json; the exit code."""
    verified = run.ckpt.verify_first()
    mem = run.dist.allgather_json(run.memory_row())
    layout = run.model.layout
    results = {
        "a_loss_monotone": loss_invariant(run, start_step),
        "b_params_identical": invariants.params_identical(run.replicas.mismatches, run.replicas.checked),
        "c_optimizer_memory": invariants.optimizer_memory([m["optimizer_bytes"] for m in mem],
                                                          layout.n_params, layout.padded, run.dp_world),
        "d_resume_bytes": invariants.resume_bytes(verified)}
    failed = invariants.failures(results)
    summary = report.Summary(status if not failed else "failed", run, rows, start_step, results, mem, wall,
                             fingerprint(run.model.whole()))
    report.final(summary, verified, failed, run.dist.rank)
    if run.dist.rank == 0:
        report.write_json(os.path.join(run.out, "summary.json"), summary.to_json())
    run.metrics.close()
    return 1 if failed else 0


def loss_invariant(run: Run, start_step: int) -> dict:
    """(a) on this segment's evaluation points, from its baseline (the start, or the resumed state)."""
    state, tcfg = run.state, run.tcfg
    first = (start_step, state.eval_start if start_step == 0 else run.segment_start[0])
    points = [first] + [(step, held) for step, _, held in state.losses if held is not None]
    settle = max(tcfg.warmup_steps, -(-tcfg.steps // 10))
    best = state.eval_start if start_step == 0 else run.segment_start[1]
    return invariants.loss_monotone(points, tcfg.loss_tol, tcfg.loss_tol_rel, settle, state.eval_start, best,
                                    fresh=start_step == 0)


def main(argv=None) -> None:
    stop.install()
    dist = Dist()
    settings = cli.parse_on_every_rank(argv, dist.rank)
    heap.keep_freed_memory()
    with fail_fast(dist):
        try:
            code = train(open_run(dist, settings))
        except (ConfigError, checkpoint.CheckpointError, DivergenceError) as exc:  # raised on every rank alike
            if dist.rank == 0:
                report.error(f"error: {exc}")
            code = 1 if not isinstance(exc, ConfigError) else 2
    sys.exit(code)


if __name__ == "__main__":
    main()
