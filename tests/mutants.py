"""The curated mutants of scripts/mutants: plausible bugs the tests must catch.

Each mutant is one file, an exact snippet of it and the snippet's replacement, and the tests that
must catch it, run in order with `pytest -x` until one fails. A test entry starting with "mpi:" runs
under `mpirun -n 4` (the collective suite); the others are serial pytest node ids. A snippet that
is no longer in its file (or is there more than once) makes the mutant STALE: update it after a
refactor so the list keeps testing what it says.

Not a test module (pytest collects test_*.py only); scripts/mutants reads MUTANTS.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str               # area/what-breaks
    file: str               # path relative to the repository root
    old: str                # exact snippet, present exactly once
    new: str                # its replacement
    tests: tuple[str, ...]  # "mpi: NODE..." or "NODE..." (pytest node ids, space separated)
    bug: str                # what the mutant does, in words


HOLES = "tests/test_holes.py::"
MPI_HOLES = "mpi: tests/mpi/test_holes.py::"

MUTANTS = [
    # ---- zero: ZeroAdam -------------------------------------------------------------------------
    Mutant("zero/clip-scale-dropped", "capstone/parallel/zero.py",
           "        if scale != 1.0:\n            g *= scale\n", "",
           (MPI_HOLES + "test_clipped_update_is_adam_on_the_scaled_gradient",),
           "the issue's example: ZeroAdam.apply ignores grad_scale, so --clip is reported but not applied"),
    Mutant("zero/adam-m-bias-correction-dropped", "capstone/parallel/zero.py",
           "np.float32(lr / (1 - b1 ** new.t)))",
           "np.float32(lr))",
           ("mpi: tests/mpi/test_zero.py",), "Adam without 1 / (1 - beta1^t)"),
    Mutant("zero/revert-keeps-the-update", "capstone/parallel/zero.py",
           "            self.state, self.before, self.revertible = self.before, self.state, False\n",
           "            self.revertible = False\n",
           ("mpi: tests/mpi/test_zero.py",), "the guard's undo republishes the diverged state"),
    Mutant("zero/finiteness-skips-the-tail", "capstone/parallel/zero.py",
           "np.isfinite(rows).all() and np.isfinite(a[full:]).all()", "np.isfinite(rows).all()",
           ("tests/test_guard.py::test_state_finiteness_sees_one_bad_value_anywhere",),
           "a NaN in the last (shard size mod 1024) values of master, m or v is not seen"),
    Mutant("params/word-sum-of-half-the-buffer", "capstone/model/fingerprint.py",
           "    even = u.size - u.size % 2\n", "    even = u.size // 4 * 2\n",
           ("tests/test_invariants.py",), "the cheap replica digest covers only the first half of the parameters"),
    Mutant("zero/reduce-scatter-max", "capstone/parallel/comm.py",
           "return self.mpi.Ireduce_scatter(send, recv, counts, op=MPI.SUM)",
           "return self.mpi.Ireduce_scatter(send, recv, counts, op=MPI.MAX)",
           ("mpi: tests/mpi/test_zero.py",), "gradients combined with MAX instead of summed"),
    Mutant("zero/grad-norm-of-own-shard", "capstone/parallel/reduce.py",
           "return GradStats(total[1], math.sqrt(total[0]), Flags(total[2] > 0, total[3] > 0))",
           "return GradStats(total[1], math.sqrt(mine), Flags(total[2] > 0, total[3] > 0))",
           ("mpi: tests/mpi/test_zero.py",), "the gradient norm (clipping, guard) of the rank's shard only"),
    Mutant("zero/publish-without-allgather", "capstone/parallel/zero.py",
           '        self.dp.Allgather(self.params, "allgather of the updated parameters", "allgather")\n', "",
           ("mpi: tests/mpi/test_zero.py",), "each rank sees only its own updated shard"),
    Mutant("zero/weight-decay-on-every-parameter", "capstone/parallel/zero.py",
           "                t2[z] = 0.0\n",
           "                pass\n",
           ("mpi: tests/mpi/test_zero.py",), "AdamW decay applied to biases and LayerNorm too"),

    # ---- train: the step ------------------------------------------------------------------------
    Mutant("train/clip-scale-not-passed", "capstone/parallel/zero.py",
           "        grad_scale = clip / norm if clip else 1.0\n", "        grad_scale = 1.0\n",
           (HOLES + "test_clipped_training_steps_match_a_reference", HOLES + "test_clip_end_to_end"),
           "the clipped norm is logged but the update uses the raw gradient"),
    Mutant("train/clip-scale-inverted", "capstone/parallel/zero.py",
           "grad_scale = clip / norm if clip else 1.0", "grad_scale = norm / clip if clip else 1.0",
           (HOLES + "test_clipped_training_steps_match_a_reference",), "norm / clip instead of clip / norm"),
    Mutant("train/replica-check-without-gather", "capstone/parallel/replicas.py",
           'self.world.Allgather(every, "allgather of the parameter fingerprints", "allgather_checks", send=mine)',
           "every[:] = mine",
           (MPI_HOLES + "test_one_rank_with_other_parameters_fails_the_run",),
           "invariant (b) compares each rank's fingerprint with itself"),
    Mutant("train/diverged-update-kept", "capstone/train.py",
           "    undo = run.guard.undoes(r.rollback)\n", "    undo = False\n",
           ("tests/test_guard.py::test_overflowing_update_is_rolled_back_before_anything_keeps_it",),
           "a rolled-back update is not undone"),
    Mutant("train/checkpoint-error-aborts", "capstone/train.py",
           "except (ConfigError, checkpoint.CheckpointError, DivergenceError) as exc:",
           "except (ConfigError, DivergenceError) as exc:",
           ("tests/test_resume.py::test_incompatible_config_is_refused",),
           "a refused checkpoint ends in MPI_ABORT instead of a clean exit 1"),

    # ---- checkpoint -----------------------------------------------------------------------------
    Mutant("checkpoint/shard-sha256-not-checked", "capstone/checkpoint/reader.py",
           "    if digest != stored:\n", "    if False:\n",
           ("mpi: tests/mpi/test_checkpoint.py::test_corrupted_byte_is_rejected_on_every_rank",),
           "a corrupt shard is read without checking its digest"),
    Mutant("checkpoint/reshard-offset", "capstone/checkpoint/__init__.py",
           "out[:, a - lo:b - lo] = data[:, a - r * old:b - r * old]",
           "out[:, a - lo:b - lo] = data[:, a - lo:b - lo]",
           ("mpi: tests/mpi/test_checkpoint.py::test_reshard_from_all_ranks_to_fewer",),
           "resharding reads the saved shard at the new shard's offset"),
    Mutant("checkpoint/retention-deletes-newest", "capstone/checkpoint/files.py",
           "for _, path in complete_checkpoints(directory)[:-keep_last]:",
           "for _, path in complete_checkpoints(directory)[keep_last:]:",
           ("mpi: tests/mpi/test_checkpoint.py::test_retention_keeps_newest_and_pointer",),
           "--keep-last deletes from the wrong end"),
    Mutant("checkpoint/first-checkpoint-not-protected", "capstone/checkpoint/saver.py",
           'protect = [self.manifests[0]["path"]] if self.manifests else []', "protect = []",
           (HOLES + "test_keep_last_keeps_the_newest_and_the_one_to_verify",),
           "--keep-last deletes the checkpoint invariant (d) must reload"),
    Mutant("checkpoint/wall-clock-minutes-as-seconds", "capstone/checkpoint/cadence.py",
           "time.monotonic() - self.last_save >= 60 * self.minutes",
           "time.monotonic() - self.last_save >= self.minutes",
           (HOLES + "test_wall_clock_checkpoints_are_spaced_by_the_interval",),
           "--ckpt-every-minutes read as seconds (a save almost every step)"),
    Mutant("checkpoint/wall-clock-never-reset", "capstone/checkpoint/saver.py",
           "        self.cadence.saved()\n        return man\n", "        return man\n",
           (HOLES + "test_wall_clock_checkpoints_are_spaced_by_the_interval",),
           "after the first interval every step saves"),
    Mutant("checkpoint/inspect-does-not-verify", "capstone/checkpoint/__main__.py",
           "    ok = all(good for good, _ in lines)\n",
           '    ok = args.command == "inspect" or all(good for good, _ in lines)\n',
           (HOLES + "test_checkpoint_inspect",), "inspect prints the manifest and exits 0 without checking"),

    # ---- resume ---------------------------------------------------------------------------------
    Mutant("resume/cursor-from-step-times-new-batch", "capstone/run.py",
           "    run.state, run.resumed_from = state, path\n",
           "    state.cursor = state.step * run.global_batch\n    run.state, run.resumed_from = state, path\n",
           (HOLES + "test_resharding_to_another_global_batch_neither_repeats_nor_skips_samples",),
           "the issue's example: after 4 -> 3 ranks samples 36..47 are seen twice"),
    Mutant("resume/auto-ignores-unpointed-file", "capstone/checkpoint/resume.py",
           "newest = pointed or (complete[-1][1] if complete else None)", "newest = pointed",
           ("tests/test_resume.py::test_kill_during_the_first_save_then_resume_auto",),
           "--resume auto starts fresh when the first save died before its pointer"),
    Mutant("startup/serial-h5py-on-many-ranks", "capstone/run.py",
           "    if world.size == 1:\n        report.say(\"note: h5py has no MPI support",
           "    if world.size >= 1:\n        report.say(\"note: h5py has no MPI support",
           (HOLES + "test_h5py_without_mpi_refuses_more_than_one_rank_at_startup",),
           "no start-up refusal: the run trains and fails at its first save"),

    # ---- guard and stop -------------------------------------------------------------------------
    Mutant("guard/loss-spike-not-checked", "capstone/guard.py",
           '        if last is not None and loss > self.spike_factor * last:\n            return "loss_spike"\n', "",
           (MPI_HOLES + "test_bad_training_loss_on_one_rank_skips_the_batch_on_every_rank",),
           "a spiking training loss is trained on"),
    Mutant("guard/nonfinite-loss-not-checked", "capstone/guard.py",
           '        if not math.isfinite(loss):\n            return "loss_nonfinite"\n', "",
           (MPI_HOLES + "test_bad_training_loss_on_one_rank_skips_the_batch_on_every_rank",),
           "a non-finite training loss is not recognised as such"),
    Mutant("stop/only-rank-0-signal-counts", "capstone/train.py",
           "Flags(stop.requested(), run.cadence.clock_due())",
           "Flags(run.grid.world.rank == 0 and stop.requested(), run.cadence.clock_due())",
           (HOLES + "test_a_signal_to_one_rank_stops_every_rank_at_a_step_boundary",),
           "a signal that reaches another rank than 0 is ignored"),
    Mutant("stop/sigterm-not-handled", "capstone/runtime/signals.py",
           "for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):", "for sig in (signal.SIGUSR1, signal.SIGINT):",
           (HOLES + "test_a_signal_to_one_rank_stops_every_rank_at_a_step_boundary",),
           "SIGTERM kills the rank instead of a checkpoint and a clean stop"),

    # ---- data -----------------------------------------------------------------------------------
    Mutant("data/micro-batch-index", "capstone/data/synthetic.py",
           "return self.samples(cursor + (micro * world + rank) * self.B, self.B)",
           "return self.samples(cursor + (rank * world + micro) * self.B, self.B)",
           (HOLES + "test_datastream_micro_batches_of_a_step_are_its_global_batch",),
           "rank and micro-batch swapped: samples overlap and are skipped"),

    # ---- invariants -----------------------------------------------------------------------------
    Mutant("invariants/tolerance-of-the-absolute-loss", "capstone/invariants.py",
           "allowed = tol + rel * (start - best)", "allowed = tol + rel * start",
           ("tests/test_invariants.py",), "(a) allows a rise in proportion to the loss, not to the progress"),

    # ---- schedule -------------------------------------------------------------------------------
    Mutant("schedule/cosine-counted-from-step-0", "capstone/lr.py",
           "progress = min(1.0, (step - warmup - 1) / span)", "progress = min(1.0, (step - 1) / span)",
           ("tests/test_guard.py::test_warmup_cosine_schedule", HOLES + "test_cosine_schedule_end_to_end"),
           "the cosine starts as if warmup steps were decay steps"),
    Mutant("schedule/update-ignores-schedule", "capstone/train.py",
           "run.opt.apply(run.reducer.grad_shard, r.lr, r.grad_norm)",
           "run.opt.apply(run.reducer.grad_shard, run.tcfg.lr, r.grad_norm)",
           (HOLES + "test_cosine_schedule_end_to_end",), "the scheduled lr is logged, the peak lr is used"),

    # ---- kernels --------------------------------------------------------------------------------
    Mutant("kernels/gelu-derivative", "capstone/model/kernels.py",
           "d *= 1.5 * GELU_A * GELU_K", "d *= 0.5 * GELU_A * GELU_K",
           ("tests/test_model.py",), "d/du of the cubic term without its 3"),
    Mutant("heap/trim-at-256-MiB", "capstone/runtime/heap.py",
           "        libc.mallopt(-1, -1)         # M_TRIM_THRESHOLD: -1, never trim",
           "        libc.mallopt(-1, 256 << 20)",
           ("tests/test_heap.py",), "the old fixed trim threshold: freed activations return to the OS every step"),
    Mutant("kernels/gelu-row-blocks-drop-the-ragged-end", "capstone/model/kernels.py",
           "    return [slice(s, s + rows) for s in range(0, len(u), rows)]",
           "    return [slice(s, s + rows) for s in range(0, len(u) - rows + 1, rows)]",
           ("tests/test_model.py",), "the GELU's row blocks leave the last, shorter block unwritten"),
    Mutant("zero/decay-mask-in-global-offsets", "capstone/model/params.py",
           "decays[1 + a - lo:1 + b - lo] = 1", "decays[1 + a:1 + b] = 1",
           ("mpi: tests/mpi/test_zero.py",), "the weight-decay runs of a shard placed at its global offsets"),
    Mutant("kernels/attention-backward-unscaled", "capstone/model/kernels.py",
           "    gqkv[:, :, :2] *= 1.0 / math.sqrt(D)                         # d S / d (q k^T)\n", "",
           ("tests/test_model.py",), "attention backward forgets 1/sqrt(D)"),
    Mutant("kernels/layernorm-backward-projection", "capstone/model/kernels.py",
           "            gr -= xh * mean_gx\n", "",
           ("tests/test_model.py",), "LayerNorm backward without the xhat projection"),
    Mutant("kernels/embedding-repeated-tokens", "capstone/model/kernels.py",
           "out[0][sorted_ids[starts]] = np.add.reduceat(g[order], starts, axis=0)", "out[0][ids] = g",
           ("tests/test_model.py",), "embedding gradient overwritten, not summed, for repeated tokens"),
    Mutant("backward/first-micro-batch-adds-to-stale-gradients", "capstone/model/backward.py",
           "        if _landing.fresh and _landing.untouched.pop(id(sink), None) is not None:\n",
           "        if False:\n",
           ("tests/test_backward.py",), "the zero-fill is gone but the first micro-batch still adds to the buffer"),
    Mutant("backward/unreached-sink-keeps-last-step", "capstone/model/backward.py",
           "        sink.fill(0.0)\n", "        pass\n",
           ("tests/test_backward.py",), "a parameter no VJP reached keeps the previous step's gradient"),
    Mutant("backward/summed-gradient-not-copied", "capstone/model/backward.py",
           "            if g is not sink:", "            if False:",
           ("tests/test_backward.py",), "a gradient autograd summed (not written in place) never lands"),
    Mutant("backward/saved-activations-kept", "capstone/model/backward.py",
           "    if _landing.once:\n        saved.clear()\n", "    pass\n",
           ("tests/test_backward.py",), "a block keeps every activation to the end of the backward pass (the old peak)"),

    # ---- exit codes, no pickle, setup -----------------------------------------------------------
    Mutant("cli/bad-flags-exit-1", "capstone/cli.py",
           '            print(f"error: {exc}", file=sys.stderr, flush=True)\n        sys.exit(2)',
           '            print(f"error: {exc}", file=sys.stderr, flush=True)\n        sys.exit(1)',
           ("tests/test_train.py::test_bad_flags_fail_cleanly_on_every_rank",),
           "bad flags exit 1, the README promises 2"),
    Mutant("nopickle/lowercase-allreduce", "capstone/parallel/comm.py",
           '        self.wait(self.mpi.Iallreduce(MPI.IN_PLACE, v, op=MPI.SUM), what, kind, "allreduce", v.nbytes)\n'
           '        return [float(x) for x in v]',
           "        return [float(x) for x in self.mpi.allreduce(v, op=MPI.SUM)]",
           (MPI_HOLES + "test_training_checkpoints_resume_and_data_without_pickle",),
           "a lowercase mpi4py collective: pickles every step (caught at run time)"),
    Mutant("nopickle/lowercase-bcast", "capstone/parallel/values.py",
           "    def bcast_json(self, value, root: int = 0):\n",
           "    def bcast_json(self, value, root: int = 0):\n        return self.mpi.bcast(value, root=root)\n",
           (HOLES + "test_no_pickle_in_capstone",), "bcast_json through pickle (caught in the source)"),
    Mutant("setup/autograd-not-installed", "scripts/setup",
           '"$PY" -m pip install -q numpy autograd mpi4py pytest', '"$PY" -m pip install -q numpy mpi4py pytest',
           ("tests/test_packaging.py",), "setup no longer installs a declared dependency (a comment still names it)"),
]
