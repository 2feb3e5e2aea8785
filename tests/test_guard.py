"""Divergence guard, gradient accumulation, clipping and the schedule, end to end and in unit form."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from capstone.cli import RunOptions, Settings
from capstone.config import ModelConfig, TrainConfig
from capstone.step.guard import Guard
from capstone.config import learning_rate
from capstone.collective.comm import Comm
from capstone.run import build

from conftest import by_step, mpi_env, mpirun, summary


def metrics(out):
    with open(out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "step" in r]


@pytest.fixture
def clean(reference):
    return reference[2]


def test_injected_lr_spike_rolls_back_once_and_finishes(tmp_path, clean):
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--inject-lr-spike", "12:1000")
    assert res.returncode == 0, res.stderr
    assert "rollback at step 12: eval_spike" in res.stdout
    s = summary(out)
    assert [r["step"] for r in s["rollbacks"]] == [12] and s["final_step"] == 20
    assert s["rollbacks"][0]["restored_adam_t"] == 11  # update 12 is undone in its own step
    assert s["rollbacks"][0]["skipped_samples"] == [11 * 16, 12 * 16]
    events = [e["event"] for m in metrics(out) for e in m["events"]]
    assert events.count("rollback") == 1 and events.count("lr_spike_injected") == 1
    # The held-out loss of step s is measured after update s. The spiked run keeps 19 of the 20
    # updates (batch 12 is skipped), so its last held-out loss lies between the clean run's after
    # 20 updates and after 19 (+3%).
    held = {step: h for step, _, h in clean["losses"]}
    final = s["losses"][-1][2]
    assert held[20] <= final <= held[19] * 1.03, (final, held[19], held[20])
    assert all(v["ok"] for v in s["invariants"].values())


def test_injected_nan_rolls_back_once_and_optimizer_never_sees_it(tmp_path):
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--inject-nan", "7")
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert [(r["step"], r["reason"]) for r in s["rollbacks"]] == [(7, "grad_nonfinite")]
    rows = metrics(out)
    assert not rows[6]["accepted"] and rows[6]["samples"] == [7 * 8 - 8, 7 * 8]
    assert all(np.isfinite(m["param_norm"]) for m in rows)
    assert all(v["ok"] for v in s["invariants"].values())


def test_a_spike_between_evaluations_is_undone_by_the_next_batch(tmp_path):
    """--eval-every 5, spike in update 7: step 7 is not judged on the held-out set, so the update
    stays pending; step 8's training loss spikes, and that batch is skipped and update 7 reverted:
    the parameters after step 8 are exactly those after step 6 (word-sum fingerprints, not
    evaluation steps), and the run ends with every invariant ok."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--eval-every", "5", "--inject-lr-spike", "7:1000")
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert [(r["step"], r["reason"], r["restored_adam_t"]) for r in s["rollbacks"]] == [(8, "loss_spike", 6)]
    rows = metrics(out)
    assert rows[6]["eval_loss"] is None and rows[7]["eval_loss"] is None
    assert (rows[7]["param_norm"], rows[7]["fingerprint"]) == (rows[5]["param_norm"], rows[5]["fingerprint"])
    assert rows[6]["fingerprint"] != rows[5]["fingerprint"]
    assert all(v["ok"] for v in s["invariants"].values())


@pytest.mark.parametrize("flags, step", [(("--eval-every", "3"), 6), (("--eval-every", "3", "--ckpt-every", "4"), 4)],
                         ids=["evaluation-step-after-two-without", "checkpoint-step-between-evaluations"])
def test_a_held_out_spike_with_sparse_evaluations_is_undone_in_its_step(tmp_path, flags, step):
    """--eval-every 3: the update of an evaluation step (6) is judged against the held-out loss of
    step 3, though steps 4 and 5 measured none; and a checkpoint step (4) between evaluations is
    evaluated too, so its spike is undone before the save. Either way: undone in its own step
    (catches: a baseline forgotten on steps without evaluation; a checkpoint without evaluation)."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", "8", *flags, "--inject-lr-spike", f"{step}:1000")
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert [(r["step"], r["reason"], r["restored_adam_t"]) for r in s["rollbacks"]] == [(step, "eval_spike", step - 1)]
    rows = metrics(out)
    evaluated = {3, 6, 8} | ({4} if "--ckpt-every" in flags else set())   # every 3rd, checkpoints, the last
    assert {r["step"] for r in rows if r["eval_loss"] is not None} == evaluated
    assert all(v["ok"] for v in s["invariants"].values())


def test_consecutive_triggers_stop_with_an_error(tmp_path):
    res = mpirun(2, "--out", tmp_path / "run", "--inject-nan", "5:10", "--max-rollbacks", "3", timeout=60)
    assert res.returncode == 1
    assert "fired 4 times without progress" in res.stderr and "last at step 8" in res.stderr


def test_equivalent_layouts_see_the_same_samples(tmp_path):
    """-n 4, -n 2 --grad-accum 2 and -n 1 --grad-accum 4: global batch 16 sequences in all three."""
    runs = {}
    for n, k in ((4, 1), (2, 2), (1, 4)):
        out = tmp_path / f"n{n}"
        res = mpirun(n, "--out", out, "--grad-accum", k, "--steps", "10", "--clip", "1.0")
        assert res.returncode == 0, res.stderr
        runs[(n, k)] = metrics(out)
    base = runs[(4, 1)]
    for key, rows in runs.items():
        assert [r["samples"] for r in rows] == [r["samples"] for r in base], key
        for a, b in zip(rows, base):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (key, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (key, a["step"])
            assert a["grad_norm_clipped"] == pytest.approx(min(1.0, b["grad_norm"]), rel=1e-3)


def step_gradient(tmp_path, **train):
    """(loss, gradient buffer) of the first step's micro-batches of a one-rank run."""
    settings = Settings(ModelConfig(), TrainConfig(**train), RunOptions(out=str(tmp_path)), {})
    run = build(Comm(MPI.COMM_SELF), settings, str(tmp_path))
    batches = [run.data.micro_batch(0, j, 0, 1) for j in range(run.tcfg.grad_accum)]
    loss = run.model.forward_backward(batches, 1.0 / (run.global_batch * run.mcfg.seq_len))
    return loss, run.model.grads


def test_accumulated_gradient_equals_large_batch_gradient(tmp_path):
    """4 micro-batches of 2 sequences, summed, against one batch of the same 8 sequences (float32)."""
    la, small = step_gradient(tmp_path, batch_size=2, grad_accum=4)
    lb, large = step_gradient(tmp_path, batch_size=8, grad_accum=1)
    assert la == pytest.approx(lb, rel=1e-6)
    np.testing.assert_allclose(small, large, rtol=1e-4, atol=1e-7)
    assert np.abs(small).max() > 1e-3


def test_guard_verdicts():
    g = Guard(spike_factor=2.0, max_consecutive=1)
    assert g.batch_verdict(3.0, 1.0) is None and g.update_verdict(3.0, True) is None
    g.accept(3.0, 2.5)
    assert g.batch_verdict(6.5, 1.0) == "loss_spike" and g.batch_verdict(5.9, 1.0) is None
    assert g.batch_verdict(float("nan"), 1.0) == "loss_nonfinite"
    assert g.batch_verdict(1.0, float("inf")) == "grad_nonfinite"
    assert g.update_verdict(5.1, True) == "eval_spike" and g.update_verdict(4.9, True) is None
    assert g.update_verdict(1.0, False) == "update_nonfinite"
    assert g.update_verdict(float("inf"), True) == "update_nonfinite"
    g.triggered(4, "loss_spike")
    with pytest.raises(Exception, match="2 times without progress"):
        g.triggered(5, "loss_spike")
    g.state.consecutive = 0
    g.triggered(6, "eval_spike")
    g.accept(3.0, 2.4)  # an accepted update is progress: the count starts again
    g.triggered(7, "eval_spike")


def test_warmup_cosine_schedule():
    lrs = [learning_rate(s, 1.0, 10, "cosine", warmup=2, min_lr=0.1) for s in range(1, 11)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert 0.1 < lrs[-1] < 0.15, "the last step still updates; min_lr is reached one step after it"
    assert learning_rate(10, 1.0, 10, "cosine", min_lr=0.0) > 0
    assert learning_rate(7, 0.3, 10, "constant") == 0.3


def test_spike_on_a_checkpoint_step_resumes_like_the_uninterrupted_run(tmp_path):
    """The update of step 10 diverges and step 10 is checkpointed: the update is undone within
    step 10, so the checkpoint holds the good state and the resumed run equals the full run."""
    full, part = tmp_path / "full", tmp_path / "part"
    assert mpirun(4, "--out", full, "--inject-lr-spike", "10:1000").returncode == 0
    assert mpirun(4, "--out", part, "--inject-lr-spike", "10:1000", "--stop-after", "10").returncode == 0
    res = mpirun(4, "--out", part, "--resume", "latest")
    assert res.returncode == 0, res.stderr
    a, b = summary(full), summary(part)
    assert [r["step"] for r in a["rollbacks"]] == [10] and a["rollbacks"][0]["restored_adam_t"] == 9
    assert b["rollbacks"] == a["rollbacks"]
    assert b["final_param_fingerprint"] == a["final_param_fingerprint"]
    assert by_step(part) == by_step(full)


def test_overflowing_update_is_rolled_back_before_anything_keeps_it(tmp_path):
    """A learning rate of 1e41 for one step turns the parameters into inf: the update is undone in
    the same step, so no checkpoint (step 10 is one) and no later step ever holds a non-finite value."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--inject-lr-spike", "10:1e41")
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert [(r["step"], r["reason"]) for r in s["rollbacks"]] == [(10, "update_nonfinite")]
    assert all(np.isfinite(m["param_norm"]) for m in metrics(out))
    verify = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify",
                             str(out / "checkpoints" / "ckpt-00000010.h5")], capture_output=True, text=True, env=mpi_env())
    assert verify.returncode == 0
    with h5py.File(out / "checkpoints" / "ckpt-00000010.h5", "r") as f:
        assert all(np.isfinite(f[f"shards/rank{r:05d}"][...]).all() for r in range(2))


def test_every_update_diverging_stops_instead_of_alternating(tmp_path):
    """lr 1e4: every update spikes and is undone; no update is ever accepted, so the run stops
    after --max-rollbacks instead of retrying until the last step."""
    res = mpirun(2, "--out", tmp_path / "run", "--lr", "1e4", "--max-rollbacks", "3", timeout=60)
    assert res.returncode == 1
    assert "fired 4 times without progress (last at step 4: eval_spike)" in res.stderr


def test_huge_gradient_that_overflows_adam_v_is_caught():
    """|g| > 1.8e19 has a finite float64 norm but g*g overflows float32 in Adam's v."""
    from capstone.model.params import Layout
    from capstone.parallel.zero import ZeroAdam
    cfg = ModelConfig(vocab_size=5, seq_len=2, d_model=4, n_heads=1, n_layers=1)
    from capstone.parallel.buckets import BucketReducer
    from capstone.parallel.grid import Grid
    from capstone.collective.launch import serial
    from capstone.parallel.reduce import Flags
    layout = Layout.for_model(cfg, 1)
    params, grads = layout.zeros(), layout.zeros()
    grid = Grid.build(serial())
    opt, reducer = ZeroAdam(grid.dp, layout, params), BucketReducer(grid, layout, grads, layout.padded)
    grads[5] = 3e19
    stats = reducer.finish([1.0], Flags())
    assert np.isfinite(stats.norm) and Guard().batch_verdict(1.0, stats.norm) is None
    with np.errstate(over="ignore"):
        opt.apply(reducer.grad_shard, 1e-3, stats.norm)
    assert not opt.finite()


def test_a_diverged_last_update_is_undone_too(tmp_path, reference):
    """The spike lands on the last step: judged in that step, undone; the final state and the
    final checkpoint are the clean run's state after 19 updates."""
    out, reference_dir = tmp_path / "run", reference[0]
    res = mpirun(4, "--out", out, "--inject-lr-spike", "20:1000")
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert [(r["step"], r["reason"]) for r in s["rollbacks"]] == [(20, "eval_spike")]
    assert s["final_param_fingerprint"][1] == by_step(reference_dir)[19][2]
    assert s["checkpoints"][-1]["step"] == 20


def test_a_violated_invariant_fails_the_run(tmp_path):
    """lr x10 for one step raises the held-out loss by about 27%: below the guard's 2x, so the
    update is kept, and invariant (a) reports it: exit 1 on every rank, status failed."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--inject-lr-spike", "12:10")
    assert res.returncode == 1
    assert "INVARIANT VIOLATED" in res.stdout and "(a) loss not decreasing" in res.stdout and "at step 12" in res.stdout
    s = summary(out)
    assert s["status"] == "failed" and not s["invariants"]["a_loss_monotone"]["ok"]
    assert all(s["invariants"][k]["ok"] for k in ("b_params_identical", "c_memory", "d_resume_bytes"))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_state_finiteness_sees_one_bad_value_anywhere(bad):
    """ShardState.finite (the update's verdict) checks rows of 1024 values with one BLAS pass and
    the tail apart: one bad value in any array, in a full row or in the tail, is seen."""
    from capstone.step.state import ShardState
    n = 3 * 1024 + 5
    for row in range(3):
        for i in (0, 1023, 2048 + 17, n - 1):
            arrays = [np.ones(n, dtype=np.float32) for _ in range(3)]
            assert ShardState(*arrays).finite()
            arrays[row][i] = bad
            assert not ShardState(*arrays).finite(), (row, i)


def test_guard_without_the_undo_judges_the_batch_only():
    """--no-guard-undo: the batch's verdicts stay; a held-out spike is kept (nothing can undo it);
    a non-finite update cannot be taken back, so it ends the run."""
    g = Guard(spike_factor=2.0, max_consecutive=3, undo=False)
    g.accept(3.0, 2.5)
    assert g.batch_verdict(6.5, 1.0) == "loss_spike" and g.batch_verdict(1.0, float("nan")) == "grad_nonfinite"
    assert g.update_verdict(5.1, True) is None and g.update_verdict(1.0, False) == "update_nonfinite"
    g.accept(3.0, None)   # an update not judged on the held-out set: a later bad batch cannot undo it either
    assert not g.undoes("loss_spike") and not g.undoes("update_nonfinite")
    g.triggered(8, "loss_spike")
    with pytest.raises(Exception, match="step 9: the update made the optimizer state .* --no-guard-undo"):
        g.triggered(9, "update_nonfinite")


def test_adam_without_the_undo_copy_updates_in_place_to_the_same_bits():
    from capstone.collective.launch import serial
    from capstone.model.params import Layout
    from capstone.parallel.grid import Grid
    from capstone.parallel.zero import ZeroAdam
    layout = Layout.for_model(ModelConfig(vocab_size=5, seq_len=2, d_model=4, n_heads=1, n_layers=1), 1)
    grid, rng = Grid.build(serial()), np.random.default_rng(0)
    start = rng.standard_normal(layout.padded).astype(np.float32)
    opts = [ZeroAdam(grid.dp, layout, start.copy(), weight_decay=0.1, undo=undo) for undo in (True, False)]
    assert opts[1].before is None and opts[1].before_nbytes() == 0 < opts[0].before_nbytes()
    for _ in range(3):
        g = rng.standard_normal(layout.padded).astype(np.float32)
        for opt in opts:
            opt.apply(g.copy(), 1e-2, 1.0)
    assert opts[0].params.tobytes() == opts[1].params.tobytes() and opts[0].state.t == opts[1].state.t == 3


def test_no_undo_overflowing_update_ends_the_run_before_anything_keeps_it(tmp_path):
    """--no-guard-undo, lr 1e41 at step 10 (a checkpoint step of 5, 10...): the state turns non-finite and
    cannot be restored, so the run stops in that step (exit 1, status diverged, the reason once);
    no checkpoint of step 10 or later exists and the ones before it are finite."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--no-guard-undo", "--inject-lr-spike", "10:1e41", "--ckpt-every", "5")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.count("--no-guard-undo keeps no copy to undo it") == 1, res.stderr
    s = summary(out)
    assert s["status"] == "diverged" and s["final_step"] == 10
    assert all(np.isfinite(m["param_norm"]) for m in metrics(out)) and max(m["step"] for m in metrics(out)) < 10
    saved = sorted((out / "checkpoints").glob("ckpt-*.h5"))
    assert [p.name for p in saved] == ["ckpt-00000005.h5"]
    for path in saved:
        with h5py.File(path, "r") as f:
            assert all(np.isfinite(f[f"shards/rank{r:05d}"][...]).all() for r in range(2))


def test_a_resume_keeps_the_guard_without_its_undo(tmp_path):
    """--no-guard-undo is a memory mode the checkpoint keeps: a resume without the flag holds no copy,
    and says nothing changed; --guard-undo brings the copy back and the start lists the change."""
    out, flags = tmp_path / "run", ("--steps", 6, "--ckpt-every", 2)
    assert mpirun(2, "--out", out, *flags, "--no-guard-undo", "--stop-after", 2).returncode == 0
    res = mpirun(2, "--out", out, *flags, "--stop-after", 4, "--resume", "latest")
    assert res.returncode == 0 and "guard_undo" not in res.stdout, res.stdout + res.stderr
    assert {r["guard_bytes"] for r in summary(out)["memory"]["per_rank"]} == {0}
    res = mpirun(2, "--out", out, *flags, "--guard-undo", "--resume", "latest")
    assert res.returncode == 0 and "guard_undo: False -> True" in res.stdout, res.stdout + res.stderr
    assert all(r["guard_bytes"] == r["optimizer_bytes"] > 0 for r in summary(out)["memory"]["per_rank"])
