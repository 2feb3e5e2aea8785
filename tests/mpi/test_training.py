"""Collective tests that close holes a broken implementation used to slip through (issue 17).

Each test says which bug it catches; scripts/mutants applies those bugs and checks that it does.
"""

import os
import pickle

import numpy as np
import pytest
from mpi4py import MPI

from capstone import checkpoint
from capstone.checkpoint import resume as resume_plan
from capstone.cli import RunOptions, Settings
from capstone.config import ModelConfig, TrainConfig
from capstone.model.params import Layout, init_params
from capstone.parallel.buckets import BucketReducer
from capstone.parallel.reduce import Flags
from capstone.parallel.zero import ZeroAdam
from capstone.run import build as build_run
from capstone.run import check_parallel_io
from capstone.run import start as start_run
from capstone.train import train


def build(world, mcfg, tcfg, opts):
    return build_run(world, Settings(mcfg, tcfg, opts, {}), opts.out)


def start(run):
    """What open_run does after building: check the I/O stack, pick the checkpoint, start."""
    check_parallel_io(run.grid.world)
    start_run(run, resume_plan.resolve(run.grid.world, run.opts.resume, run.ckpt.directory))


CFG = ModelConfig(vocab_size=13, seq_len=4, d_model=8, n_heads=2, n_layers=1)


def summary(world, out):
    """summary.json of a run in `out` (rank 0 wrote it), on every rank."""
    world.Barrier()
    import json
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def metrics_rows(world, out):
    """The step rows of metrics.jsonl (rank 0 wrote it), on every rank."""
    world.Barrier()
    import json
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "step" in r]


def adam_reference(p, grads, lr, b1, b2, eps):
    """Textbook Adam on the full vector, float64 (no weight decay)."""
    p, m, v = p.astype(np.float64), np.zeros(len(p)), np.zeros(len(p))
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


def test_clipped_update_is_adam_on_the_scaled_gradient(grid, world):
    """ZeroAdam.apply(grad_shard, lr, norm) with --clip is Adam on clip / norm x the reduced
    gradient (catches: the clipping scale dropped, inverted or applied to the wrong quantity). The
    gradients' size changes a lot from step to step, so clipping really changes the update: Adam
    alone is nearly invariant to a constant scale, which is why a dropped scale went unnoticed."""
    layout = Layout.for_model(CFG, world.size)
    params = init_params(layout, CFG, 3) if world.rank == 0 else layout.zeros()
    grads = layout.zeros()
    opt = ZeroAdam(grid.dp, layout, params, (0.9, 0.99), 1e-8, 0.0, clip=1.0)
    reducer = BucketReducer(grid, layout, grads, layout.padded)
    start_params, clip = params.copy(), 1.0
    clipped, raw = [], []
    for step, size in enumerate([1.0, 30.0, 0.01, 5.0]):   # step 2 is below the clip: scale 1
        mine = np.random.default_rng([step, world.rank]).standard_normal(layout.padded).astype(np.float32) * size
        mine[layout.n_params:] = 0.0
        grads[...] = mine
        stats = reducer.finish([0.0], Flags())
        total = sum(np.random.default_rng([step, r]).standard_normal(layout.padded).astype(np.float32).astype(np.float64)
                    * size for r in range(world.size))
        total[layout.n_params:] = 0.0
        assert stats.norm == pytest.approx(np.linalg.norm(total), rel=1e-5)
        scale = clip / stats.norm if stats.norm > clip else 1.0
        assert opt.apply(reducer.grad_shard, 1e-2, stats.norm) == min(clip, stats.norm)
        clipped.append(total * scale)
        raw.append(total)
    want = adam_reference(start_params, clipped, 1e-2, 0.9, 0.99, 1e-8)
    unclipped = adam_reference(start_params, raw, 1e-2, 0.9, 0.99, 1e-8)
    assert np.abs(want - unclipped).max() > 1e-3, "the test must be able to tell clipped from unclipped"
    np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)


def _run(world, out, **train_cfg):
    return build(world, ModelConfig(), TrainConfig(**train_cfg), RunOptions(out=out, quiet=True))


def test_one_rank_with_other_parameters_fails_the_run(world, shared_tmp):
    """Invariant (b) for real: the last rank flips one bit of its parameters after the update of
    step 2; the run must report exactly that step and fail (exit code 1) on every rank (catches: a
    replica check that compares each rank with itself, e.g. a lost allgather)."""
    out = os.path.join(shared_tmp, "run")
    run = _run(world, out, steps=4, ckpt_every=0)
    if world.rank == world.size - 1:
        real, calls = run.opt.apply, [0]

        def apply_then_flip(grad_shard, lr, norm):
            clipped = real(grad_shard, lr, norm)
            calls[0] += 1
            if calls[0] == 2:
                run.model.params.view(np.uint32)[7] ^= 1  # lowest mantissa bit of one weight
            return clipped
        run.opt.apply = apply_then_flip
    start(run)
    code = train(run)
    s = summary(world, out)
    if world.size == 1:
        assert code == 0  # nothing to compare with: the flip is not a disagreement
        return
    assert code == 1 and s["status"] == "failed"
    b = s["invariants"]["b_params_identical"]
    assert not b["ok"] and b["n_mismatches"] == 1 and b["mismatches"][0]["step"] == 2, b
    fps = b["mismatches"][0]["fingerprints"]
    assert len({str(x) for x in fps[:-1]}) == 1 and fps[-1] != fps[0]
    assert all(s["invariants"][k]["ok"] for k in ("a_loss_monotone", "c_memory", "d_resume_bytes"))


@pytest.mark.parametrize("factor, reason", [(float("inf"), "loss_nonfinite"), (100.0, "loss_spike")])
def test_bad_training_loss_on_one_rank_skips_the_batch_on_every_rank(world, shared_tmp, factor, reason):
    """The training loss of step 3 is non-finite (or 100x) on one rank only: every rank skips that
    batch before any update (Adam step and parameters unchanged, its samples consumed) and the run
    goes on and completes (catches: either batch check removed from the guard)."""
    out = os.path.join(shared_tmp, "run")
    run = _run(world, out, steps=5, ckpt_every=0)
    if world.rank == min(1, world.size - 1):
        real, calls = run.schedule.forward_backward, [0]

        def forward_backward(batches, step):
            losses = real(batches, step)
            calls[0] += 1
            return [losses[0] * factor] + losses[1:] if calls[0] == 3 else losses
        run.schedule.forward_backward = forward_backward
    start(run)
    assert train(run) == 0
    s = summary(world, out)
    g = run.global_batch
    assert [(r["step"], r["reason"]) for r in s["rollbacks"]] == [(3, reason)]
    assert s["rollbacks"][0]["restored_adam_t"] == 2 and s["rollbacks"][0]["skipped_samples"] == [2 * g, 3 * g]
    rows = metrics_rows(world, out)
    assert not rows[2]["accepted"] and rows[2]["eval_loss"] is None
    assert rows[2]["fingerprint"] == rows[1]["fingerprint"] != rows[3]["fingerprint"]
    assert [r["samples"] for r in rows] == [[i * g, (i + 1) * g] for i in range(5)]
    assert run.opt.state.t == 4 and s["status"] == "completed"
    assert all(v["ok"] for v in s["invariants"].values())


@pytest.fixture
def no_pickle(monkeypatch):
    """pickle (and mpi4py's pickling of lowercase collectives) raise while the test runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    class Refused:
        def __init__(self, *args, **kwargs):
            refuse()

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(pickle, "Pickler", Refused)
    monkeypatch.setattr(pickle, "Unpickler", Refused)
    MPI.pickle.__init__(refuse, refuse)
    try:
        with pytest.raises(AssertionError, match="pickle was used"):
            MPI.COMM_SELF.bcast({"x": 1})  # the trap works
        yield
    finally:
        MPI.pickle.__init__()


def test_training_checkpoints_resume_and_data_without_pickle(world, shared_tmp, no_pickle):
    """README: 'No pickle: HDF5 datasets and JSON only, in checkpoints and in every collective'.
    Train, checkpoint, resume (collective load), verify with the serial tool and read a prepared
    dataset, all with pickle made to raise (catches: a lowercase mpi4py collective, np.load with
    allow_pickle, an object dtype in a checkpoint)."""
    from capstone.checkpoint.__main__ import main as checkpoint_tool
    from capstone.data.tokens import TokenData
    from capstone.prepare import prepare
    out = os.path.join(shared_tmp, "run")
    run = _run(world, out, steps=3, ckpt_every=2)
    start(run)
    assert train(run) == 0
    again = build(world, ModelConfig(), TrainConfig(steps=4, ckpt_every=2), RunOptions(out=out, resume="latest", quiet=True))
    start(again)
    assert again.state.step == 3 and train(again) == 0
    assert summary(world, out)["final_step"] == 4
    if world.rank == 0:
        assert checkpoint_tool(["verify", os.path.join(out, "checkpoints", "ckpt-00000004.h5")]) == 0
        with open(os.path.join(shared_tmp, "t.txt"), "w") as f:
            f.write("to be, or not to be, that is the question\n" * 40)
        prepare([os.path.join(shared_tmp, "t.txt")], os.path.join(shared_tmp, "ds"))
        data = TokenData(os.path.join(shared_tmp, "ds"), 8, 2, 1).verify()
        x, y = data.micro_batch(0, 0, 0, 1)
        assert x.shape == (2, 8) and data.eval_batch(0, 1)[0].shape[1] == 8
    world.Barrier()


def test_h5py_without_mpi_is_refused_before_anything_is_written(world, shared_tmp, monkeypatch):
    """More than one rank and an h5py without MPI: start() refuses on every rank before creating
    the run directory (catches: the refusal skipped, so the run would train and fail at its first
    save). One rank is allowed (serial h5py writes the same format)."""
    monkeypatch.setattr(checkpoint, "mpi_io_available", lambda: False)
    out = os.path.join(shared_tmp, "run")
    run = _run(world, out, steps=2)
    if world.size == 1:
        pytest.skip("one rank may use serial h5py")
    with pytest.raises(Exception, match="h5py has no MPI support") as err:
        start(run)
    assert type(err.value).__name__ == "ConfigError"
    world.Barrier()
    assert not os.path.exists(out)
