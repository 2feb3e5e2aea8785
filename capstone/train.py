"""`python -m capstone.train`: the training loop and its entry point.

The loop does forward+backward, then composes the narrow interfaces: `ZeroAdam` (reduce-scatter,
Adam on the shard, allgather), the divergence `Guard`, `checkpoint.save/load/verify_snapshot`,
and `Dist` for small agreement collectives. It never calls MPI or HDF5 itself.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import sys
import time

import numpy as np

from . import checkpoint, cli, faults, invariants, report, resume
from .config import ConfigError, ModelConfig, TrainConfig
from .data import EVAL_SEQUENCES, DataStream, make_corpus
from .dist import Dist, fail_fast
from .guard import UPDATE_REASONS, DivergenceError, Guard
from .model import loss_and_grad, loss_sum
from .params import Layout, fingerprint, init_params
from .schedule import learning_rate
from .zero import ZeroAdam


class Trainer:
    """One run: state, the step, checkpoints and the end-of-run checks."""

    def __init__(self, dist: Dist, mcfg: ModelConfig, tcfg: TrainConfig, opts: cli.RunOptions):
        self.dist, self.mcfg, self.tcfg, self.opts = dist, mcfg, tcfg, opts
        self.layout = Layout.for_model(mcfg, dist.world)
        self.params = init_params(self.layout, mcfg, tcfg.seed) if dist.rank == 0 else self.layout.zeros()
        self.grads = self.layout.zeros()
        self.pviews, self.gviews = self.layout.views(self.params), self.layout.views(self.grads)
        self.opt = ZeroAdam(dist.comm, self.layout, self.params, self.grads, (tcfg.beta1, tcfg.beta2),
                            tcfg.eps, tcfg.weight_decay)
        self.stream = DataStream(make_corpus(tcfg.corpus_seed, tcfg.corpus_tokens, mcfg.vocab_size),
                                 mcfg.seq_len, tcfg.batch_size, tcfg.seed)
        self.global_batch = tcfg.batch_size * tcfg.grad_accum * dist.world   # sequences per step
        self.eval_x, self.eval_y = self.stream.eval_batch(dist.rank, dist.world)
        self.out = dist.bcast_json(opts.out or time.strftime("runs/run-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        self.ckpt_dir = os.path.join(self.out, "checkpoints")
        self.guard = Guard(tcfg.spike_factor, tcfg.max_rollbacks)
        self.step, self.cursor, self.losses = 0, 0, []
        self.mismatches, self.checked, self.manifests, self.rollbacks = [], 0, [], []
        self.snapshot, self.eval_start = None, None
        self.resumed_from = None
        self.last_save_time = time.monotonic()

    # ---- start-up -------------------------------------------------------------------------
    def prepare(self) -> None:
        """Collective: call on all ranks. Create the run directory, resume if asked."""
        if not checkpoint.mpi_io_available() and self.dist.world == 1:
            report.say("note: h5py has no MPI support; one rank writes the same checkpoint format with serial "
                       "h5py. More ranks need h5py built against parallel HDF5 (scripts/setup).", self.dist.rank)
        if not checkpoint.mpi_io_available() and self.dist.world > 1:
            raise ConfigError("h5py has no MPI support, so the ranks cannot write one shared checkpoint file. "
                              "Run scripts/setup (it builds h5py against parallel HDF5: CC=mpicc HDF5_MPI=ON "
                              "HDF5_DIR=<prefix> pip install --no-build-isolation --no-binary=h5py h5py), "
                              "or run on one rank, which writes the same format with serial h5py.")
        path = resume.resolve(self.dist, self.opts.resume, self.ckpt_dir)
        if path is not None:
            self._resume(path)
        else:
            self.eval_start = self.dist.allreduce_sum([self.eval_share()])[0]
            self.guard.last_eval = self.eval_start
        self.metrics = report.MetricsLog(os.path.join(self.out, "metrics.jsonl") if self.dist.rank == 0 else None)
        self.metrics.write({"event": "start", "world": self.dist.world, "start_step": self.step,
                            "resumed_from": self.resumed_from, "time": time.time()})

    def expect(self) -> dict:
        """What a checkpoint must match to be resumed by this run: the model, and what defines the
        data stream and the held-out batch (changing those would be another experiment)."""
        return {"model_config": dataclasses.asdict(self.mcfg), "data": self.data_identity()}

    def data_identity(self) -> dict:
        return {"seed": self.tcfg.seed, "corpus_seed": self.tcfg.corpus_seed, "corpus_tokens": self.tcfg.corpus_tokens}

    def _resume(self, path: str) -> None:
        state, meta = checkpoint.load(self.dist, path, self.layout, self.expect())
        self.opt.load_state(state["master"], state["m"], state["v"], state["t"])
        self.guard.from_meta(meta["guard"])
        self.eval_start = meta["eval_start"]
        self.step, self.cursor = meta["step"], meta["data_cursor"]
        self.losses = [tuple(x) for x in meta["losses"]]
        self.rollbacks = meta["rollbacks"]
        self.resumed_from = path
        if self.step >= self.tcfg.steps:
            raise ConfigError(f"{path} is at step {self.step} and --steps is {self.tcfg.steps}: nothing left to do. "
                              f"Pass --steps larger than {self.step} to train on.")
        changed = {k: (v, getattr(self.tcfg, k)) for k, v in meta["train_config"].items()
                   if getattr(self.tcfg, k, v) != v}
        if changed:
            report.say("note: resuming with changed settings: " +
                       ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items())), self.dist.rank)
        report.say(f"resumed from {path}: step {self.step}, written by {meta['world_size']} ranks, now "
                   f"{self.dist.world}; sample cursor {self.cursor}; logical digests verified", self.dist.rank)

    # ---- one step -------------------------------------------------------------------------
    def forward_backward(self) -> float:
        """Sum this rank's micro-batch gradients into the flat buffer; return its loss share."""
        self.grads.fill(0.0)
        scale = 1.0 / (self.global_batch * self.mcfg.seq_len)
        local = 0.0
        for j in range(self.tcfg.grad_accum):
            x, y = self.stream.micro_batch(self.cursor, j, self.dist.rank, self.dist.world)
            loss, g = loss_and_grad(self.pviews, x, y, self.mcfg, scale)
            for name, gi in g.items():
                self.gviews[name] += gi
            local += loss
        return local

    def _injected(self, step: int):
        nan, spike = self.opts.inject_nan, self.opts.inject_lr_spike
        nan_now = nan is not None and nan[0] <= step < nan[0] + nan[1]
        return nan_now, (spike[1] if spike is not None and spike[0] == step else 1.0)

    def eval_share(self) -> float:
        """This rank's share of the held-out loss (summed over ranks it is the mean per token)."""
        if len(self.eval_x) == 0:
            return 0.0
        return float(loss_sum(self.pviews, self.eval_x, self.eval_y, self.mcfg, 1.0 / (EVAL_SEQUENCES * self.mcfg.seq_len)))

    def train_step(self, s: int) -> dict:
        t0 = time.perf_counter()
        faults.point("raise_in_step", self.dist.rank, s)
        with np.errstate(over="ignore", invalid="ignore"):  # a diverging step is the guard's to judge
            local = self.forward_backward()
        nan_now, lr_mult = self._injected(s)
        if nan_now and self.dist.rank == 0:
            self.grads[0] = float("nan")
        t1 = time.perf_counter()
        clock_due = self.tcfg.ckpt_every_minutes > 0 and self.dist.rank == 0 and \
            time.monotonic() - self.last_save_time >= 60 * self.tcfg.ckpt_every_minutes
        stats = self.opt.reduce_gradients(extras=[local, float(_STOP_REQUESTED[0]), float(clock_due)])
        loss, stop, clock = float(stats.extras[0]), stats.extras[1] > 0, stats.extras[2] > 0
        lr = learning_rate(s, self.tcfg.lr, self.tcfg.steps, self.tcfg.lr_schedule, self.tcfg.warmup_steps,
                           self.tcfg.min_lr) * lr_mult
        events, clipped, eval_loss = [], stats.norm, None
        reason = self.guard.batch_verdict(loss, stats.norm)
        if reason is None:
            if lr_mult != 1.0:
                events.append({"event": "lr_spike_injected", "mult": lr_mult})
            clipped, eval_loss, reason = self._update(lr, stats.norm)
            if reason is None:
                self.guard.accept(loss, eval_loss)
                self.losses.append((s, loss, eval_loss))
        if reason:
            self._rollback(s, reason, loss, eval_loss, events)
        t2 = time.perf_counter()
        first = self.cursor
        self.cursor += self.global_batch
        norm, fp = self._check_identical(s)
        tm, applied = self.opt.timings, float(eval_loss is not None)  # an update ran (kept or undone)
        return {"step": s, "loss": loss, "eval_loss": eval_loss, "accepted": reason is None,
                "grad_norm": stats.norm, "grad_norm_clipped": clipped, "lr": lr,
                "tokens": self.global_batch * self.mcfg.seq_len, "samples": [first, self.cursor],
                "step_ms": 1e3 * (t2 - t0), "fwd_bwd_ms": 1e3 * (t1 - t0),
                "comm_ms": 1e3 * (tm["reduce_scatter"] + applied * tm["allgather"]),
                "reduce_scatter_ms": 1e3 * tm["reduce_scatter"], "allgather_ms": 1e3 * applied * tm["allgather"],
                "optimizer_ms": 1e3 * applied * tm["adam"],
                "tokens_per_s": self.global_batch * self.mcfg.seq_len / max(t2 - t0, 1e-9),
                "param_norm": norm, "fingerprint": fp, "events": events, "_stop": bool(stop), "_clock": bool(clock)}

    def _update(self, lr: float, norm: float):
        """Collective: call on all ranks. Clip, apply the ZeRO-1 update, then judge it with one
        small Allreduce (held-out loss, non-finite state). Returns (clipped norm, held-out loss,
        the guard's reason to undo the update or None)."""
        self.guard.keep(self.opt.state())
        scale, clipped = 1.0, norm
        if self.tcfg.clip > 0 and norm > self.tcfg.clip:
            scale, clipped = self.tcfg.clip / norm, self.tcfg.clip
        with np.errstate(over="ignore", invalid="ignore"):  # judged just below
            self.opt.apply(lr, scale)
            eval_local = self.eval_share()
        eval_loss, nonfinite = self.dist.allreduce_sum([eval_local, float(not self.opt.state_finite())])
        return clipped, eval_loss, self.guard.update_verdict(eval_loss, nonfinite == 0)

    def _rollback(self, s: int, reason: str, loss: float, eval_loss, events: list) -> None:
        """Skip this batch; undo its update if one was applied (identical decision on every rank)."""
        self.guard.triggered(s, reason)
        if reason in UPDATE_REASONS:
            good = self.guard.good
            self.opt.load_state(good["master"], good["m"], good["v"], good["t"])
        event = {"event": "rollback", "reason": reason, "step": s, "loss": report.jsonable(loss),
                 "eval_loss": report.jsonable(eval_loss),
                 "restored_adam_t": self.opt.t, "skipped_samples": [self.cursor, self.cursor + self.global_batch]}
        events.append(event)
        self.rollbacks.append(event)
        held = "-" if eval_loss is None else f"{eval_loss:.6g}"
        last = "-" if self.guard.last_loss is None else f"{self.guard.last_loss:.6g}"
        report.say(f"  rollback at step {s}: {reason} (loss {loss:.6g}, held-out {held}; last accepted {last}, "
                   f"held-out {self.guard.last_eval:.6g}); state of Adam step {self.opt.t} in effect, samples "
                   f"[{self.cursor}, {self.cursor + self.global_batch}) skipped", self.dist.rank)

    def _check_identical(self, s: int):
        """Invariant (b): every rank's parameter fingerprint equals rank 0's."""
        norm, fp = fingerprint(self.params)
        every = self.dist.allgather_json([norm, fp])
        self.checked += 1
        if any(x != every[0] for x in every):
            self.mismatches.append({"step": s, "fingerprints": every})
        return norm, fp

    # ---- checkpoints ----------------------------------------------------------------------
    def save(self) -> dict:
        """Collective: call on all ranks."""
        extra = {"model_config": dataclasses.asdict(self.mcfg), "train_config": dataclasses.asdict(self.tcfg),
                 "data_cursor": self.cursor, "global_batch": self.global_batch, "losses": self.losses,
                 "guard": self.guard.to_meta(), "rollbacks": self.rollbacks, "eval_start": self.eval_start,
                 "data": self.data_identity()}
        state = self.opt.state()
        protect = [self.manifests[0]["path"]] if self.manifests else []
        man = checkpoint.save(self.dist, self.ckpt_dir, self.step, state, self.layout, extra,
                              self.tcfg.keep_last, protect)
        if self.snapshot is None:
            self.snapshot = np.stack([state[row] for row in checkpoint.ROWS])
        self.manifests.append(man)
        self.last_save_time = time.monotonic()
        return man

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> int:
        """Collective: call on all ranks. Train to the last step (or a stop request), check the
        invariants, report. Returns the exit code, identical on every rank."""
        rank, t_start = self.dist.rank, time.perf_counter()
        report.say(f"capstone: {self.dist.world} ranks, {self.layout.n_params} parameters (padded "
                   f"{self.layout.padded}, shard {self.layout.shard}), global batch {self.global_batch} x "
                   f"{self.mcfg.seq_len} tokens, run dir {self.out}", rank)
        report.say(report.step_header(), rank)
        status, rows = "completed", []
        while self.step < self.tcfg.steps:
            self.step += 1
            m = self.train_step(self.step)
            stop, clock = m.pop("_stop") or self.step == self.opts.stop_after, m.pop("_clock")
            due = (self.tcfg.ckpt_every and self.step % self.tcfg.ckpt_every == 0) or clock
            if due or stop or self.step == self.tcfg.steps:
                man = self.save()
                m["events"].append({"event": "checkpoint", "path": man["path"]})
            self.metrics.write({k: v for k, v in m.items() if not k.startswith("_")})
            rows.append(m)
            if not self.opts.quiet:
                report.say(report.step_row(m), rank)
            if self.opts.sleep_per_step:
                time.sleep(self.opts.sleep_per_step)
            if stop and self.step < self.tcfg.steps:
                status = "preempted"
                report.say(f"stopping at step {self.step} (signal or --stop-after): checkpoint saved; "
                           f"rerun with --out {self.out} --resume latest to continue", rank)
                break
        return self.finish(status, rows, time.perf_counter() - t_start)

    def memory_row(self) -> dict:
        return {"rank": self.dist.rank, "params_bytes": self.params.nbytes,
                "grads_bytes": self.grads.nbytes + self.opt.g_shard.nbytes,
                "optimizer_bytes": self.opt.optimizer_nbytes(), "guard_bytes": self.guard.nbytes(),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def finish(self, status: str, rows: list, wall: float) -> int:
        """Collective: call on all ranks. Invariants, report, summary.json; returns the exit code."""
        rank = self.dist.rank
        verified = checkpoint.verify_snapshot(self.dist, self.manifests[0]["path"], self.layout, self.expect(),
                                              self.snapshot) if self.manifests else None
        mem = self.dist.allgather_json(self.memory_row())
        results = {
            "a_loss_monotone": invariants.loss_monotone([(0, self.eval_start)] + [(h[0], h[2]) for h in self.losses],
                                                        self.tcfg.loss_tol, self.tcfg.loss_tol_rel),
            "b_params_identical": invariants.params_identical(self.mismatches, self.checked),
            "c_optimizer_memory": invariants.optimizer_memory([r["optimizer_bytes"] for r in mem],
                                                              self.layout.n_params, self.layout.padded),
            "d_resume_bytes": invariants.resume_bytes(verified)}
        failed = invariants.failures(results)
        report.say("\nmemory per rank (bytes):\n" + report.memory_table(mem), rank)
        for man in self.manifests:
            report.say(report.manifest_text(man), rank)
        report.say("\ninvariants:\n  " + "\n  ".join(invariants.describe(results, self.dist.world)), rank)
        if verified and verified["ok"]:
            report.say(f"resume verified: {verified['path']} reloads byte-equal on all {self.dist.world} ranks", rank)
        summary = {"status": status if not failed else "failed", "world_size": self.dist.world,
                   "model_config": dataclasses.asdict(self.mcfg), "train_config": dataclasses.asdict(self.tcfg),
                   "n_params": self.layout.n_params, "padded": self.layout.padded, "start_step": rows[0]["step"] - 1 if rows else self.step,
                   "final_step": self.step, "resumed_from": self.resumed_from, "losses": [list(x) for x in self.losses],
                   "steps": rows, "invariants": results, "memory": {"per_rank": mem, **report.aggregate(mem)},
                   "checkpoints": self.manifests, "rollbacks": self.rollbacks, "wall_seconds": wall,
                   "final_param_fingerprint": fingerprint(self.params)}
        if rank == 0:
            report.write_json(os.path.join(self.out, "summary.json"), summary)
        self.metrics.close()
        if failed:
            report.say("INVARIANT VIOLATED:\n  " + "\n  ".join(failed), rank)
            return 1
        report.say(f"{status} step {self.step} in {wall:.2f} s; summary {os.path.join(self.out, 'summary.json')}", rank)
        return 0


def _tune_malloc() -> None:
    """Keep freed activations in the heap instead of returning them to the OS every step."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
        libc.mallopt(-3, 256 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_STOP_REQUESTED = [False]  # set by SIGTERM/SIGUSR1 (Slurm's warning before a time limit or preemption)


def _request_stop(signum, frame) -> None:
    _STOP_REQUESTED[0] = True


def main(argv=None) -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # first, so an early signal is not fatal either
        signal.signal(sig, _request_stop)
    dist = Dist()
    try:
        if dist.rank != 0:
            sys.stdout = open(os.devnull, "w")  # --help and usage once, from rank 0
        try:
            mcfg, tcfg, opts = cli.parse(argv)
        finally:
            sys.stdout = sys.__stdout__
    except ConfigError as exc:
        if dist.rank == 0:
            report.error(f"error: {exc}")
        sys.exit(2)
    except SystemExit as exc:
        if dist.rank != 0 and exc.code:
            sys.exit(exc.code)
        raise
    _tune_malloc()
    with fail_fast(dist):
        try:
            trainer = Trainer(dist, mcfg, tcfg, opts)
            trainer.prepare()
            code = trainer.run()
        except (ConfigError, checkpoint.CheckpointError, DivergenceError) as exc:  # raised on every rank alike
            if dist.rank == 0:
                report.error(f"error: {exc}")
            code = 1 if not isinstance(exc, ConfigError) else 2
    sys.exit(code)


if __name__ == "__main__":
    main()
