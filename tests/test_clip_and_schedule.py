"""Clipping and the learning-rate schedule in the real training loop, against references written out
here (catches: the clip scale dropped or inverted, the schedule logged but not used)."""

import json
import math
import os

import numpy as np
import pytest
from mpi4py import MPI

from capstone.cli import RunOptions, Settings
from capstone.config import ModelConfig, TrainConfig
from capstone.model.gpt import Model
from capstone.collective.comm import Comm
from capstone.run import build, start
from capstone.train import train_step

from conftest import mpirun, summary


def metrics(out) -> list[dict]:
    """The step rows of metrics.jsonl; after a resume the last row of a step counts."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = {r["step"]: r for r in map(json.loads, f) if "step" in r}
    return [rows[s] for s in sorted(rows)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """6 steps on 4 ranks with the defaults (constant lr, no clipping)."""
    out = tmp_path_factory.mktemp("plain") / "run"
    res = mpirun(4, "--out", out, "--steps", "6", "--ckpt-every", "0")
    assert res.returncode == 0, res.stderr
    return out


def test_clipped_training_steps_match_a_reference(tmp_path):
    """Four steps of the real training loop with --clip 0.5 (clipping every step) against a
    reference written out here: the unclipped gradient of the same batch, scaled by clip/norm,
    then textbook Adam in float64 (catches: the scale not passed to the update, or inverted)."""
    tcfg = TrainConfig(steps=4, clip=0.5, ckpt_every=0)
    run = build(Comm(MPI.COMM_SELF), Settings(ModelConfig(), tcfg, RunOptions(out=str(tmp_path / "run"), quiet=True), {}),
                str(tmp_path / "run"))
    start(run)
    reference = Model.over(run.mcfg, run.model.layout, run.model.params.copy())
    master = run.model.params.astype(np.float64)
    p0, m, v = master.copy(), np.zeros_like(master), np.zeros_like(master)
    g_batch, b1, b2 = run.global_batch, tcfg.beta1, tcfg.beta2
    for s in range(1, 5):
        r = train_step(run, s)
        reference.params[...] = master.astype(np.float32)
        batches = [run.data.micro_batch((s - 1) * g_batch, j, 0, 1) for j in range(tcfg.grad_accum)]
        reference.forward_backward(batches, 1.0 / (g_batch * run.mcfg.seq_len))
        g = reference.grads.astype(np.float64)
        norm = float(np.linalg.norm(g))
        assert norm > tcfg.clip and r.grad_norm == pytest.approx(norm, rel=1e-5) and r.rollback is None
        assert r.grad_norm_clipped == pytest.approx(tcfg.clip)
        g *= tcfg.clip / norm
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        master -= tcfg.lr * (m / (1 - b1 ** s)) / (np.sqrt(v / (1 - b2 ** s)) + tcfg.eps)
        # Relative to the distance travelled: float32 noise is about 1e-5 after 4 steps (a few
        # near-zero gradients may flip sign), a missing or inverted clip scale 7e-3 or more.
        off = np.linalg.norm(run.model.params - master) / np.linalg.norm(master - p0)
        assert off < 1e-4, f"step {s}: the update is {off:.2e} (relative) away from the reference"


def test_clip_end_to_end(tmp_path, plain):
    """--clip 0.5 on 4 ranks: every step's gradient norm (about 1-2) is clipped, the parameters
    differ from the unclipped run's, and equal (to float tolerance) a 1-rank run with the same
    global batch (catches: clipping not applied, or clipped by a per-rank norm)."""
    runs = {}
    for n, accum in ((4, 1), (1, 4)):
        out = tmp_path / f"n{n}"
        res = mpirun(n, "--out", out, "--steps", "6", "--ckpt-every", "0", "--clip", "0.5", "--grad-accum", accum)
        assert res.returncode == 0, res.stderr
        runs[n] = (summary(out), metrics(out))
    (clipped, rows), (_, one_rows), unclipped = runs[4], runs[1], summary(plain)
    assert all(r["grad_norm"] > 0.5 and r["grad_norm_clipped"] == pytest.approx(0.5) for r in rows)
    assert clipped["final_param_fingerprint"][1] != unclipped["final_param_fingerprint"][1]
    assert [r["fingerprint"] for r in rows][1:] != [r["fingerprint"] for r in metrics(plain)][1:]
    for a, b in zip(rows, one_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["param_norm"] == pytest.approx(b["param_norm"], rel=1e-5)
    assert abs(clipped["final_param_fingerprint"][0] - unclipped["final_param_fingerprint"][0]) > 1e-3


def test_cosine_schedule_end_to_end(tmp_path, plain):
    """--lr-schedule cosine --warmup-steps 2 --min-lr 1e-3 over 6 steps: every step's lr is the
    closed form (linear warmup, then min + (lr - min)(1 + cos(pi (s - w) / (S - w))) / 2), and the
    update uses it (the parameters differ from the constant-lr run's from step 1) (catches: the
    cosine progress counted from step 0, warmup and min_lr swapped, the update ignoring the
    schedule)."""
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--steps", "6", "--ckpt-every", "0", "--lr-schedule", "cosine",
                 "--warmup-steps", "2", "--min-lr", "1e-3")
    assert res.returncode == 0, res.stderr
    lr, low, w, n = 1e-2, 1e-3, 2, 6
    want = [lr * s / w if s <= w else low + 0.5 * (lr - low) * (1 + math.cos(math.pi * (s - w - 1) / (n - w)))
            for s in range(1, n + 1)]
    rows = metrics(out)
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12, abs=0)
    assert low < rows[-1]["lr"] < lr, "the last step still updates; min_lr comes one step after it"
    constant = metrics(plain)
    assert all(a["fingerprint"] != b["fingerprint"] for a, b in zip(rows, constant))
    assert rows[0]["loss"] == constant[0]["loss"]  # same batch, same start: only the update differs
