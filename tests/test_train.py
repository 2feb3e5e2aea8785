"""End-to-end runs of `python -m capstone.train` under mpirun: the reference experiment and its
failure modes (bad flags, an exception on one rank)."""

import hashlib
import json

import h5py
import pytest

from conftest import by_step, mpirun, summary


@pytest.mark.parametrize("n", [1, 3, 5])  # 5: the flat buffer needs padding
def test_reference_run_holds_all_invariants(tmp_path, n):
    out = tmp_path / "run"
    res = mpirun(n, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    s = summary(out)
    assert s["status"] == "completed" and s["final_step"] == 20 and s["world_size"] == n
    assert {k: v["ok"] for k, v in s["invariants"].items()} == {
        "a_loss_monotone": True, "b_params_identical": True, "c_memory": True, "d_resume_bytes": True}
    assert s["invariants"]["b_params_identical"]["steps_checked"] == 20
    assert s["invariants"]["c_memory"]["measured_bytes"] == [12 * s["padded"] // n] * n
    losses = [x[1] for x in s["losses"]]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.5
    assert "resume verified" in res.stdout
    table = [line for line in res.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()
             and len(line.split()) >= 7 and "." in line.split()[1]]
    assert [int(line.split()[0]) for line in table] == list(range(1, 21))
    assert len(s["memory"]["per_rank"]) == n and "max" in s["memory"] and "mean" in s["memory"]
    with open(out / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f if '"step"' in line]
    assert [m["step"] for m in steps] == list(range(1, 21))
    assert all(m["step_ms"] > 0 and m["grad_norm"] > 0 and m["tokens"] == 4 * n * 16 for m in steps)
    with h5py.File(out / "checkpoints" / "ckpt-00000010.h5", "r") as f:  # serial, plain h5py
        assert sorted(f["shards"]) == [f"rank{r:05d}" for r in range(n)]
        for r in range(n):
            ds = f[f"shards/rank{r:05d}"]
            assert ds.attrs["sha256"] == hashlib.sha256(ds[...].tobytes()).hexdigest()


def test_same_seed_same_world_same_bits(tmp_path):
    runs = [mpirun(2, "--out", tmp_path / f"r{i}", "--steps", "6", "--ckpt-every", "0") for i in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    a, b = (summary(tmp_path / f"r{i}") for i in range(2))
    assert a["final_param_fingerprint"] == b["final_param_fingerprint"]
    assert a["losses"] == b["losses"] and by_step(tmp_path / "r0") == by_step(tmp_path / "r1")
    c = mpirun(2, "--out", tmp_path / "r3", "--steps", "6", "--seed", "7")
    assert summary(tmp_path / "r3")["final_param_fingerprint"] != a["final_param_fingerprint"], c.stderr


@pytest.mark.parametrize("flags, words", [
    (["--d-model", "30"], "divisible by n_heads"),
    (["--steps", "0"], "steps must be a positive integer"),
    (["--lr", "-1"], "lr must be > 0"),
    (["--inject-lr-spike", "12"], "STEP:MULT"),
])
def test_bad_flags_fail_cleanly_on_every_rank(tmp_path, flags, words):
    res = mpirun(3, "--out", tmp_path / "run", *flags, timeout=60)
    assert res.returncode == 2 and "MPI_ABORT" not in res.stderr  # README: bad input exits 2, cleanly
    assert words in res.stderr
    assert res.stderr.count(words) == 1, "the error is printed once, by rank 0"
    assert not (tmp_path / "run").exists(), "a refused run writes nothing"


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--ckpt-every", "2", env_extra={"CAPSTONE_FAULT": "raise_in_step:2:3"}, timeout=60)
    # the rank's own line, then comm.Abort (Open MPI's help text for it is sometimes garbled under load)
    assert res.returncode == 1 and "[rank 2] aborting all ranks" in res.stderr
    assert "[rank 2/4] error: InjectedFault" in res.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["ckpt-00000002.h5", "ckpt-00000002.h5.sha256",
                                                                      "latest"]
    assert summary_absent(out)


def summary_absent(out):
    return not (out / "summary.json").exists()


def test_too_short_corpus_is_a_clean_error(tmp_path):
    res = mpirun(3, "--out", tmp_path / "run", "--corpus-tokens", "300", timeout=60)
    assert res.returncode == 2 and res.stderr.count("raise --corpus-tokens") == 1
    assert "Traceback" not in res.stderr and "MPI_ABORT" not in res.stderr


def test_fresh_run_refuses_to_overwrite_an_earlier_runs_checkpoints(tmp_path):
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--steps", "2", "--ckpt-every", "1").returncode == 0
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    res = mpirun(2, "--out", out, "--steps", "2")
    assert res.returncode == 2 and "--resume latest" in res.stderr and "MPI_ABORT" not in res.stderr
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before


def test_out_that_is_a_file_is_a_clean_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    res = mpirun(2, "--out", target, timeout=60)
    assert res.returncode == 2 and "is not a directory" in res.stderr and "MPI_ABORT" not in res.stderr
    assert target.read_text() == "keep me"


def test_h5py_without_mpi_one_rank_writes_the_same_format(tmp_path, monkeypatch):
    """The fallback for an h5py built without MPI: a single rank writes the file with serial h5py
    (same format; the checkpoint tool verifies it); more ranks are refused at start-up."""
    from mpi4py import MPI

    from capstone import checkpoint
    from capstone.checkpoint.__main__ import main as ckpt_main
    from capstone.cli import RunOptions, Settings
    from capstone.config import ModelConfig, TrainConfig
    from capstone.collective.comm import Comm
    from capstone.run import open_run
    from capstone.train import train
    monkeypatch.setattr(checkpoint, "mpi_io_available", lambda: False)
    settings = Settings(ModelConfig(), TrainConfig(steps=4, ckpt_every=2), RunOptions(out=str(tmp_path / "run"), quiet=True), {})
    assert train(open_run(Comm(MPI.COMM_SELF), settings)) == 0
    assert ckpt_main(["verify", str(tmp_path / "run" / "checkpoints" / "ckpt-00000004.h5")]) == 0

    two_ranks = Comm(MPI.COMM_SELF)
    two_ranks.size = 2  # what the file layer sees on 2 ranks
    with pytest.raises(checkpoint.CheckpointError, match="no MPI support"):
        checkpoint._open(str(tmp_path / "x.h5"), "w", two_ranks)
    assert not (tmp_path / "x.h5").exists()
