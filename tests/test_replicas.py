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
    assert all(s["invariants"][k]["ok"] for k in ("a_loss_monotone", "c_memory", "d_resume_bytes"))


@pytest.mark.parametrize("rank", [1, 3], ids=["tp-rank-1-of-replica-0", "tp-rank-1-of-replica-1"])
def test_a_bit_flipped_in_one_tensor_parallel_slice_fails_the_run(tmp_path, rank):
    """--tp 2 on 4 ranks: each slice has two replicas (ranks 0, 2 hold slice 0; ranks 1, 3 slice 1).
    One bit of one rank's slice flipped after step 2 is a disagreement of that slice's replicas:
    (b) fails at step 2 whichever slice it is (catches: a check of one slice's replicas only)."""
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--tp", "2", "--steps", "4", "--ckpt-every", "0",
                 env_extra={"CAPSTONE_FAULT": f"flip_param_bit:{rank}:2"}, timeout=90)
    assert res.returncode == 1, res.stdout + res.stderr
    b = summary(out)["invariants"]["b_params_identical"]
    assert not b["ok"] and b["n_mismatches"] == 1 and b["mismatches"][0]["step"] == 2, b
    fps = b["mismatches"][0]["fingerprints"]
    assert fps[rank] != fps[rank ^ 2] and fps[1 - rank % 2] == fps[3 - rank % 2]   # the other slice agrees
