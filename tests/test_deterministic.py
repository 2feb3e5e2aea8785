"""--deterministic: the same global batch gives the same bits on every layout ranks x grad_accum
(losses, gradient norms, held-out losses, parameters, checkpoints), also across a resharding
resume; the default mode is untouched. See docs/deterministic.md."""

import glob
import json
import os

import pytest

from capstone import checkpoint

from conftest import mpirun, step_rows

# clipping, weight decay and a schedule on, so the global-scalar paths are exercised too
COMMON = ("--deterministic", "--steps", "8", "--clip", "1.0", "--weight-decay", "0.1", "--lr-schedule", "cosine",
          "--warmup-steps", "2", "--eval-every", "2", "--quiet")
KEYS = ("loss", "grad_norm", "grad_norm_clipped", "eval_loss", "accepted", "param_norm", "fingerprint", "samples")

def run(tmp_path, name, ranks, accum, *extra):
    out = tmp_path / name
    res = mpirun(ranks, "--out", out, "--grad-accum", accum, *COMMON, *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def table(out):
    return [{k: r[k] for k in KEYS} for r in step_rows(out)]


def final_digests(out):
    """The logical digests (master, m, v) and the step of the run's newest checkpoint."""
    path = sorted(glob.glob(os.path.join(out, "checkpoints", "ckpt-*.h5")))[-1]
    meta = checkpoint.read_meta_file(path)
    return meta["step"], meta["logical_sha256"]


@pytest.fixture(scope="module")
def four_by_one(tmp_path_factory):
    return run(tmp_path_factory.mktemp("det"), "4x1", 4, 1, "--global-batch", "16")


@pytest.mark.parametrize("ranks,accum", [(1, 4), (2, 2)])
def test_layouts_of_16_are_bit_identical(tmp_path, four_by_one, ranks, accum):
    out = run(tmp_path, f"{ranks}x{accum}", ranks, accum, "--global-batch", "16")
    assert table(out) == table(four_by_one)            # floats compared with ==, fingerprints as strings
    assert final_digests(out) == final_digests(four_by_one)
    assert len(table(out)) == 8 and all(r["eval_loss"] is not None for r in table(out)[1::2])


def test_layouts_of_12_are_bit_identical_also_through_a_rollback(tmp_path):
    """1x3 vs 3x1 (a world size that is not a power of two); a NaN gradient at step 3 is rolled back alike."""
    a = run(tmp_path, "1x3", 1, 3, "--global-batch", "12", "--inject-nan", "3")
    b = run(tmp_path, "3x1", 3, 1, "--global-batch", "12", "--inject-nan", "3")
    assert table(a) == table(b) and not table(a)[2]["accepted"]
    assert final_digests(a) == final_digests(b)


@pytest.mark.parametrize("flags", [("--bucket-mb", "0.01"), ("--bucket-mb", "0.01", "--no-overlap")],
                         ids=["default-overlap", "no-overlap"])
def test_layouts_are_bit_identical_with_several_buckets(tmp_path, flags):
    """Buckets small enough for 7 of them (the bug of issue 24: the bucket hook stayed armed in
    deterministic mode and its reduce-scatters overwrote the deterministic sums from step 7 on):
    1x4, 2x2 and 4x1 agree bit for bit, with the default overlap and without it."""
    from capstone.config import ModelConfig
    from capstone.model.params import Layout
    from capstone.parallel.buckets import plan
    assert len(plan(Layout.for_model(ModelConfig(), 4), int(0.01 * 2**20) // 4)) >= 3
    runs = [run(tmp_path, f"{r}x{a}", r, a, "--global-batch", "16", "--steps", "12", *flags)
            for r, a in ((1, 4), (2, 2), (4, 1))]
    tables = [table(out) for out in runs]
    assert len(tables[0]) == 12 and tables[1] == tables[0] and tables[2] == tables[0]
    assert final_digests(runs[1]) == final_digests(runs[0]) == final_digests(runs[2])


def test_stop_on_4_resume_on_2_is_bit_identical(tmp_path, four_by_one):
    out = tmp_path / "resharded"
    res = mpirun(4, "--out", out, "--grad-accum", 1, *COMMON, "--global-batch", "16", "--stop-after", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    res = mpirun(2, "--out", out, "--resume", "latest", "--grad-accum", "2", "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    starts = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "start"]
    assert starts[-1]["world"] == 2 and starts[-1]["train_config"]["deterministic"] is True
    assert table(out) == table(four_by_one)
    assert final_digests(out) == final_digests(four_by_one)


def test_default_mode_differs_between_layouts(tmp_path):
    """Why the mode exists: without it, 1x4 and 4x1 round differently (so the tests above can fail)."""
    a, b = (tmp_path / "a", tmp_path / "b")
    for out, ranks, accum in ((a, 1, 4), (b, 4, 1)):
        res = mpirun(ranks, "--out", out, "--grad-accum", accum, "--global-batch", "16", "--steps", "3", "--quiet")
        assert res.returncode == 0, res.stdout + res.stderr
    assert step_rows(a, "fingerprint") != step_rows(b, "fingerprint")


def one_rank_run(tmp_path, **train):
    from mpi4py import MPI

    from capstone.cli import RunOptions, Settings
    from capstone.config import ModelConfig, TrainConfig
    from capstone.collective.comm import Comm
    from capstone.run import build
    settings = Settings(ModelConfig(), TrainConfig(**train), RunOptions(out=str(tmp_path)), {})
    return build(Comm(MPI.COMM_SELF), settings, str(tmp_path))


def test_default_mode_builds_none_of_it(tmp_path):
    """The default step is the code it was: the bucketed reducer and the row-split HeldOut (its
    speed is the bench's); --deterministic chooses its reducer and held-out blocks."""
    from capstone.data.heldout import HeldOut
    from capstone.parallel import deterministic
    from capstone.parallel.buckets import BucketReducer
    run = one_rank_run(tmp_path / "a", grad_accum=2)
    assert type(run.reducer) is BucketReducer and type(run.heldout) is HeldOut
    det = one_rank_run(tmp_path / "b", grad_accum=2, deterministic=True)
    assert isinstance(det.reducer, deterministic.DeterministicReducer)
    assert isinstance(det.heldout, deterministic.HeldOutBlocks)


def test_deterministic_gradient_is_the_same_gradient(tmp_path):
    """Same math, another order: the tree-summed gradient, loss and norm match the default ones to rounding."""
    import numpy as np

    from capstone.parallel.reduce import Flags
    runs = [one_rank_run(tmp_path / m, grad_accum=3, deterministic=m == "det") for m in ("default", "det")]
    batches = [runs[0].data.micro_batch(0, j, 0, 1) for j in range(3)]
    ref, stats = (r.reducer.finish(r.schedule.forward_backward(batches, 1), Flags()) for r in runs)
    assert np.allclose(runs[1].reducer.grad_shard, runs[0].reducer.grad_shard, rtol=1e-5, atol=1e-8)
    assert abs(stats.loss - ref.loss) < 1e-6 and abs(stats.norm - ref.norm) < 1e-6 * ref.norm
    held = [r.heldout.loss_share() for r in runs]
    assert abs(held[0] - held[1]) < 1e-6
