"""The reference experiment keeps its bits across the redesign of issue 24: the code of commit
BEFORE (the last one before it) and the current code, run here on the same machine (BLAS kernels
round differently on other CPUs, so recorded values would test the machine), give the same losses,
norms, fingerprints and checkpoint digests at every step. Needs the repository's history (a clone)."""

import subprocess

import pytest

from conftest import code_at, ROOT, mpi_env, step_rows, summary

BEFORE = "0d6c940"   # main before the one design of issue 24 (the 47-mutant suite's code)
KEYS = ("loss", "eval_loss", "grad_norm", "grad_norm_clipped", "lr", "param_norm", "fingerprint", "accepted")


@pytest.fixture(scope="module")
def before_code(tmp_path_factory):
    """The capstone package of commit BEFORE, unpacked from git into a directory of its own."""
    return code_at(tmp_path_factory, BEFORE)


def run_with(code_dir, out, *args):
    env = {**mpi_env(), "PYTHONPATH": str(code_dir)}
    res = subprocess.run(["mpirun", "-n", "4", "--oversubscribe", "python", "-m", "capstone.train", "--out", str(out),
                          *map(str, args)], capture_output=True, text=True, timeout=300, env=env, cwd=str(code_dir))
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def digests(out):
    return [(m["step"], m["logical_sha256"], sorted(d["sha256"] for d in m["datasets"].values()))
            for m in summary(out)["checkpoints"]]


def test_reference_run_is_bit_identical_to_the_code_before(reference, before_code, tmp_path):
    out, _, _ = reference
    old = run_with(before_code, tmp_path / "before")
    assert [{k: r[k] for k in KEYS} for r in step_rows(out)] == [{k: r[k] for k in KEYS} for r in step_rows(old)]
    assert digests(out) == digests(old)
    assert summary(out)["final_param_fingerprint"] == summary(old)["final_param_fingerprint"]


@pytest.mark.parametrize("flags", [("--grad-accum", "2", "--global-batch", "16", "--clip", "1.0", "--weight-decay", "0.1",
                                    "--lr-schedule", "cosine", "--warmup-steps", "3", "--inject-nan", "5")],
                         ids=["accum-clip-decay-cosine-nan"])
def test_other_default_paths_are_bit_identical_to_the_code_before(before_code, tmp_path, flags):
    """Accumulation, clipping, weight decay, the schedule and a rollback: the same bits as before."""
    new = run_with(ROOT, tmp_path / "now", *flags)
    old = run_with(before_code, tmp_path / "before", *flags)
    assert [{k: r[k] for k in KEYS} for r in step_rows(new)] == [{k: r[k] for k in KEYS} for r in step_rows(old)]
    assert digests(new) == digests(old)


def test_a_checkpoint_of_the_code_before_resumes_bit_identically(reference, before_code, tmp_path):
    """The code before the redesign stops the reference run at step 10 (as if preempted); this code
    resumes its checkpoint and ends where the uninterrupted reference run of this code ends."""
    out, _, _ = reference
    run = run_with(before_code, tmp_path / "run", "--stop-after", "10")
    assert summary(run)["status"] == "preempted"
    run_with(ROOT, run, "--resume", "latest")
    assert summary(run)["status"] == "completed"
    assert [r["step"] for r in step_rows(run)] == list(range(1, 21))
    resumed = [{k: r[k] for k in KEYS} for r in step_rows(run) if r["step"] > 10]
    assert resumed == [{k: r[k] for k in KEYS} for r in step_rows(out) if r["step"] > 10]
    assert summary(run)["final_param_fingerprint"] == summary(out)["final_param_fingerprint"]
    assert digests(run)[-1] == digests(out)[-1]
