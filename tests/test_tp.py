"""--tp K end to end (each test launches mpirun): TP x DP grids against the 1-rank run with the
same global batch, refused grids, and checkpoints restored across grids."""

import json
import os
import shutil

import h5py
import numpy as np
import pytest

from capstone.checkpoint import open_verified
from conftest import mpirun, step_rows, summary

GLOBAL = 16   # sequences per step: 4 ranks x batch 4 (the reference), or 1 rank x grad-accum 4


def final_master(out, step=20):
    """The full master vector of checkpoint `step` (a TP run stores it in the 1-rank layout)."""
    f, meta = open_verified(os.path.join(out, "checkpoints", f"ckpt-{step:08d}.h5"))
    with f:
        data = np.concatenate([f[name][0] for name in sorted(meta["datasets"])])
    return data[:meta["n_params"]], meta


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "one"
    res = mpirun(1, "--out", out, "--grad-accum", 4, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def assert_same_params(got, want, tol):
    """The assembled full parameters: their norm within tol (relative). Element by element, Adam
    divides by sqrt(v), so a parameter whose gradient is ~0 moves by a rounding-sized gradient
    times lr: 20 steps leave ~2e-4 element differences even between the 1-rank and the plain
    4-rank data-parallel run (--tp 1), so elements get a looser bound."""
    norm = np.linalg.norm(want.astype(np.float64))
    assert abs(np.linalg.norm(got.astype(np.float64)) - norm) <= tol * norm
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def assert_same_run(out, ref, tol=1e-5):
    for a, b in zip(step_rows(ref, "loss"), step_rows(out, "loss"), strict=True):
        assert abs(a - b) <= tol * abs(a), (a, b)
    want, _ = final_master(ref)
    got, _ = final_master(out)
    assert_same_params(got, want, tol)


@pytest.mark.parametrize("n, k", [(4, 1), (4, 2), (4, 4), (2, 2)])
def test_tp_grid_equals_the_one_rank_run(tmp_path, one_rank, n, k):
    out = tmp_path / "run"
    res = mpirun(n, "--out", out, "--tp", k, "--global-batch", GLOBAL, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    s = summary(out)
    assert all(v["ok"] for v in s["invariants"].values()), s["invariants"]
    assert_same_run(out, one_rank)
    assert step_rows(out, "samples") == step_rows(one_rank, "samples")
    _, meta = final_master(out)
    if k > 1:
        assert meta["tensor_parallel"]["tp"] == k and meta["tensor_parallel"]["dp"] == n // k


def test_reference_experiment_with_tp2_on_4_ranks(tmp_path):
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--tp", 2)
    assert res.returncode == 0, res.stdout + res.stderr
    inv = summary(out)["invariants"]
    assert all(v["ok"] for v in inv.values()), inv
    assert "(b) ok" in res.stdout and "(c) ok" in res.stdout


@pytest.mark.parametrize("n, k, why", [(4, 3, "does not divide the 4 ranks"), (4, 8, "does not divide the 4 ranks"),
                                       (4, 4, "does not divide n_heads 2")])
def test_bad_tp_refused_before_anything_is_written(tmp_path, n, k, why):
    out = tmp_path / "run"
    extra = ["--n-heads", 2] if "n_heads" in why else []
    res = mpirun(n, "--out", out, "--tp", k, *extra)
    assert res.returncode == 2, res.stdout + res.stderr
    assert why in res.stderr and res.stderr.count("error:") == 1, res.stderr
    assert not out.exists()


def test_tp_and_deterministic_refused(tmp_path):
    res = mpirun(4, "--out", tmp_path / "run", "--tp", 2, "--deterministic")
    assert res.returncode == 2 and "--deterministic is not supported with --tp 2" in res.stderr, res.stderr


@pytest.mark.parametrize("n, k", [(4, 1), (4, 4), (1, 1), (2, 2)])
def test_tp2_dp2_checkpoint_resumes_on_other_grids(tmp_path_factory, one_rank, n, k):
    base = tmp_path_factory.getbasetemp() / "tp2x2"
    if not (base / "checkpoints" / "ckpt-00000010.h5").exists():
        res = mpirun(4, "--out", base, "--tp", 2, "--global-batch", GLOBAL, "--stop-after", 10, "--quiet")
        assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path_factory.mktemp("resume") / "run"
    shutil.copytree(base / "checkpoints", out / "checkpoints")
    res = mpirun(n, "--out", out, "--resume", "latest", "--tp", k, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary(out)["invariants"]["d_resume_bytes"]["ok"]
    assert step_rows(out, "step")[0] == 11
    assert_same_run_from(out, one_rank, 11)


def assert_same_run_from(out, ref, first, tol=1e-5):
    ref_loss = dict(zip(step_rows(ref, "step"), step_rows(ref, "loss")))
    for s, loss in zip(step_rows(out, "step"), step_rows(out, "loss")):
        assert abs(loss - ref_loss[s]) <= tol * abs(ref_loss[s]), (s, loss, ref_loss[s])
    want, _ = final_master(ref)
    got, _ = final_master(out)
    assert_same_params(got, want, tol)
