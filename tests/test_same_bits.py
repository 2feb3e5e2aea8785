"""Issue 49: --deterministic gives the same bits on every layout: tensor, context and pipeline
parallelism, every ZeRO stage, recomputation, dropout with a tied head, and a stop resumed on another
layout, against the 1-rank run of the same global batch and micro-batch (B = 2 sequences).

Every metrics row (loss, both gradient norms, held-out loss, param_norm, fingerprint, the verdict,
the samples) and the final checkpoint's logical digests are compared with `==`. The default split
(--det-split 4) cuts the 4 heads into 4 pieces and each sequence into 4 chunks. docs/deterministic.md.
"""

import pytest

from conftest import mpirun, summary
from test_deterministic import final_digests, table

BASE = ("--deterministic", "--steps", "6", "--global-batch", "8", "--n-layers", "2", "--clip", "1.0",
        "--weight-decay", "0.1", "--lr-schedule", "cosine", "--warmup-steps", "2", "--eval-every", "2",
        "--ckpt-every", "3", "--bucket-mb", "0.01", "--quiet")
OPTIONS = ("--dropout", "0.1", "--tie-embeddings", "--lr", "3e-3")
# name: (ranks, grad_accum, flags): every layout has B = 8 / (replicas x grad_accum) = 2
LAYOUTS = {
    "dp2-tp2-zero0": (4, 2, ("--tp", "2", "--zero-stage", "0")),
    "tp4-zero2": (4, 4, ("--tp", "4", "--zero-stage", "2")),
    "pp2-tp2-zero3": (4, 4, ("--tp", "2", "--pp", "2", "--zero-stage", "3")),
    "cp2-zero3-reshard-step": (2, 4, ("--cp", "2", "--zero-stage", "3", "--reshard", "step")),
    "cp2-tp2-recompute": (4, 4, ("--cp", "2", "--tp", "2", "--recompute")),
    "dp2-pp2-cp2": (8, 2, ("--pp", "2", "--cp", "2", "--pp-schedule", "zb-h1")),
}


def run(tmp_path, name, ranks, accum, *flags, options=()):
    out = tmp_path / name
    res = mpirun(ranks, "--out", out, "--grad-accum", accum, *BASE, *options, *flags, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run(tmp_path_factory.mktemp("bits"), "one", 1, 4)


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_has_the_one_rank_runs_bits(name, one_rank, tmp_path):
    ranks, accum, flags = LAYOUTS[name]
    out = run(tmp_path, name, ranks, accum, *flags)
    assert table(out) == table(one_rank)
    assert final_digests(out) == final_digests(one_rank)
    assert summary(out)["final_param_fingerprint"] == summary(one_rank)["final_param_fingerprint"]


def test_the_checkpoint_tool_prints_the_fingerprint_a_run_logged(one_rank):
    """`python -m capstone.checkpoint inspect` gives the stored parameters' fingerprints of both kinds: the canonical
    one is the last step's logged one (an evaluated step: the sha256 kind)."""
    import subprocess
    import sys
    from conftest import ROOT, mpi_env
    got = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "inspect", str(one_rank)], capture_output=True,
                         text=True, env=mpi_env(), cwd=ROOT, timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"parameters: {table(one_rank)[-1]['fingerprint']} (--deterministic" in got.stdout, got.stdout


def test_dropout_and_a_tied_head_have_the_same_bits_on_another_layout(tmp_path):
    one = run(tmp_path, "one", 1, 4, options=OPTIONS)
    other = run(tmp_path, "cp2-pp2-tp2", 8, 4, "--cp", "2", "--pp", "2", "--tp", "2", options=OPTIONS)
    assert table(other) == table(one) and final_digests(other) == final_digests(one)


def test_a_stop_resumed_on_another_layout_continues_with_the_same_bits(one_rank, tmp_path):
    out = run(tmp_path, "switch", 4, 2, "--tp", "2", "--zero-stage", "1", "--stop-after", "3")
    res = mpirun(4, "--out", out, "--grad-accum", 4, *BASE, "--tp", "1", "--cp", "2", "--pp", "2", "--zero-stage", "3",
                 "--resume", "latest", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert table(out) == table(one_rank) and final_digests(out) == final_digests(one_rank)


# a second size: 6 heads, so that gcd(4, 6) = 2 pieces (not S) cut the split contractions, and a NaN at step 3 that
# the guard rolls back
SECOND = ("--d-model", "48", "--n-heads", "6", "--seq-len", "32", "--vocab-size", "96", "--inject-nan", "3")


@pytest.fixture(scope="module")
def second_one_rank(tmp_path_factory):
    return run(tmp_path_factory.mktemp("second"), "one", 1, 4, options=SECOND)


@pytest.mark.parametrize("ranks, accum, flags", [(4, 4, ("--tp", "2", "--cp", "2", "--zero-stage", "2")),
                                                 (4, 2, ("--pp", "2", "--zero-stage", "3", "--recompute"))],
                         ids=["tp2-cp2-zero2", "dp2-pp2-zero3-recompute"])
def test_a_second_size_through_a_rollback_has_the_same_bits(ranks, accum, flags, second_one_rank, tmp_path):
    out = run(tmp_path, "layout", ranks, accum, *flags, options=SECOND)
    rows = table(out)
    assert not rows[2]["accepted"] and rows == table(second_one_rank)
    assert final_digests(out) == final_digests(second_one_rank)


BEFORE = "759242b"   # main before issue 49: --deterministic's fingerprints were of each rank's part


def test_a_checkpoint_from_before_resumes_and_says_its_fingerprints_are_of_the_older_kind(tmp_path_factory):
    """Its stored vectors are canonical, so it resumes on another layout; its run's fingerprints
    were of the older kind, and the resume says so (docs/deterministic.md)."""
    from conftest import code_at, mpi_env
    import subprocess
    code, out = code_at(tmp_path_factory, BEFORE), tmp_path_factory.mktemp("old") / "run"
    old = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", "python", "-m", "capstone.train", "--out", str(out),
                          "--grad-accum", "2", *BASE, "--tp", "2", "--stop-after", "3"], capture_output=True, text=True,
                         timeout=180, env={**mpi_env(), "PYTHONPATH": str(code)}, cwd=str(code))
    assert old.returncode == 0, old.stdout + old.stderr
    res = mpirun(2, "--out", out, "--grad-accum", 4, *BASE, "--tp", "1", "--cp", "2", "--resume", "latest")
    assert res.returncode == 0, res.stdout + res.stderr        # a load verifies the logical digests or fails
    assert "fingerprints of the older kind" in res.stdout + res.stderr
    assert summary(out)["status"] == "completed"


@pytest.mark.parametrize("tie", [False, True])
def test_the_cut_arithmetic_is_the_models_gradient(tie):
    """In process, one rank: Exact's loss and every gradient equal the plain arithmetic's to float32 rounding
    (the same maths, summed in another order), with a tied head too; the bits are Exact's own."""
    import numpy as np
    from capstone.config import ModelConfig
    from capstone.model.blocks import ALONE, WHOLE
    from capstone.model.exact import Exact
    from capstone.model.gpt import Model
    from capstone.model.params import Layout, init_params
    from capstone.model.seam import Resident
    cfg = ModelConfig(n_layers=2, tie_embeddings=tie, head_bias=not tie)
    layout = Layout.for_model(cfg, 1)
    params, rng = init_params(layout, cfg, 0), np.random.default_rng(1)
    x, y = (rng.integers(0, cfg.vocab_size, (3, cfg.seq_len)) for _ in range(2))
    got = {}
    for name, arith in (("plain", WHOLE), ("cut", Exact(4, cfg.seq_len, cfg.n_heads, ALONE))):
        grads = layout.zeros()
        model = Model(cfg, layout, Resident.over(layout, params, grads), ALONE, False, arith)
        got[name] = (model.micro_batch(x, y, 1.0 / x.size, fresh=True), grads)
    assert got["cut"][0] == pytest.approx(got["plain"][0], rel=1e-6)
    assert np.allclose(got["cut"][1], got["plain"][1], rtol=1e-4, atol=1e-7)
    assert not np.array_equal(got["cut"][1], got["plain"][1])      # another order of the sums: other bits


@pytest.mark.parametrize("flags, reason", [
    (("--det-split", "3"), "--det-split must be a power of two"),
    (("--det-split", "2", "--cp", "2"), "2 x --cp 2 one that divides the chunks"),
    (("--det-split", "4", "--seq-len", "6"), "--det-split 4 must divide --seq-len 6")])
def test_a_split_that_does_not_cut_the_layout_is_refused_at_start(flags, reason, tmp_path):
    """The plan's refusal (capstone/plan.py): exit 2 on every rank, the reason once, nothing written."""
    res = mpirun(2, "--out", tmp_path / "run", "--deterministic", "--steps", "2", *flags)
    assert res.returncode == 2 and (res.stdout + res.stderr).count(reason) == 1, res.stdout + res.stderr
    assert not (tmp_path / "run").exists()


def test_the_default_split_is_the_least_that_fits(tmp_path):
    """Without --det-split: 4, or what the layout and model need (6 positions: 2; --cp 4: 8), kept by checkpoints."""
    from test_kept_modes import started
    for name, flags, split in (("six", ("--seq-len", "6"), 2), ("cp4", ("--cp", "4", "--seq-len", "32"), 8)):
        res = mpirun(4 if name == "cp4" else 2, "--out", tmp_path / name, "--deterministic", "--steps", "1", *flags)
        assert res.returncode == 0, res.stdout + res.stderr
        assert started(tmp_path / name)[-1]["modes"]["det_split"] == split


def test_bf16_has_the_same_bits_on_every_layout(tmp_path):
    """Issue 51: with --precision bf16 too (conversions are elementwise, the sums keep their fixed order, the
    gradient's messages stay float32): dropout and a tied head on cp 2 x tp 2 at ZeRO-2 and on pp 2 x tp 2 at
    ZeRO-3 with recompute, against the 1-rank bf16 run; and the bits are not fp32's."""
    bf16 = (*OPTIONS, "--precision", "bf16")
    one = run(tmp_path, "one", 1, 4, options=bf16)
    for name, flags in (("cp2-tp2", ("--cp", "2", "--tp", "2", "--zero-stage", "2")),
                        ("pp2-tp2", ("--pp", "2", "--tp", "2", "--zero-stage", "3", "--recompute"))):
        other = run(tmp_path, name, 4, 4, *flags, options=bf16)
        assert table(other) == table(one) and final_digests(other) == final_digests(one), name
    assert table(run(tmp_path, "fp32", 1, 4, options=OPTIONS))[-1]["loss"] != table(one)[-1]["loss"]
