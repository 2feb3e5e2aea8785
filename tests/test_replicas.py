"""Invariant (b) end to end: one bit of one rank's parameters flipped (CAPSTONE_FAULT=flip_param_bit)
fails the run at that step, whether the step compares sha256 or the cheap word sum."""

import pytest

from conftest import mpirun, step_rows, summary


@pytest.mark.parametrize("eval_every", [1, 3])
def test_a_bit_flipped_on_one_rank_fails_the_run(tmp_path, eval_every):
    """CAPSTONE_FAULT=flip_param_bit:2:2 flips one bit of rank 2's parameters after the update of
    step 2: invariant (b) reports that step and the job exits 1, whether step 2 compares sha256
    digests (an evaluation step) or word sums (--eval-every 3) (catches: a replica check that
    cannot see a real disagreement)."""
    out = tmp_path / "run"
    res = mpirun(3, "--out", out, "--steps", "4", "--ckpt-every", "0", "--eval-every", str(eval_every),
                 env_extra={"CAPSTONE_FAULT": "flip_param_bit:2:2"}, timeout=90)
    assert (step_rows(out)[1]["eval_loss"] is None) == (eval_every == 3)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "INVARIANT VIOLATED" in res.stdout and "(b) parameters differ across ranks at 1 of 4 steps" in res.stdout
    s = summary(out)
    b = s["invariants"]["b_params_identical"]
    assert s["status"] == "failed" and b["mismatches"][0]["step"] == 2
    assert all(s["invariants"][k]["ok"] for k in ("a_loss_monotone", "c_optimizer_memory", "d_resume_bytes"))
