"""The checkpoint contract end to end: real resume, resharding, crash-safe saves, integrity."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from capstone.checkpoint import files, integrity

from conftest import ROOT, by_step, flip_shard_byte, mpi_env, mpirun, summary


@pytest.fixture
def uninterrupted(reference):
    """The 20-step reference run on 4 ranks (checkpoint frequency does not change the numbers)."""
    out, _, s = reference
    return {**s, "by_step": by_step(out)}


def test_stop_and_resume_is_bit_identical(tmp_path, uninterrupted):
    out = tmp_path / "run"
    first = mpirun(4, "--out", out, "--ckpt-every", "5", "--stop-after", "10")
    assert first.returncode == 0, first.stderr
    assert summary(out)["status"] == "preempted" and summary(out)["final_step"] == 10
    second = mpirun(4, "--out", out, "--ckpt-every", "5", "--resume", "latest")
    assert second.returncode == 0, second.stderr
    s = summary(out)
    assert s["resumed_from"].endswith("ckpt-00000010.h5") and s["start_step"] == 10 and s["final_step"] == 20
    assert s["final_param_fingerprint"] == uninterrupted["final_param_fingerprint"]
    assert by_step(out) == uninterrupted["by_step"]  # every per-step loss and fingerprint, exactly
    assert all(v["ok"] for v in s["invariants"].values())


@pytest.mark.parametrize("before, after, accum", [(4, 2, 2), (4, 1, 4), (4, 3, 1), (2, 4, 1)])
def test_resume_on_another_world_size(tmp_path, uninterrupted, before, after, accum):
    """Same global batch where it divides (4->2 with accumulation 2, 4->1 with 4): the losses match
    the uninterrupted run within float tolerance. 4->3 changes the global batch (16 -> 12 sequences),
    so the sample ranges are compared: they continue at the saved cursor. 2->4 starts from a 2-rank run that used
    accumulation 2, so it is the same stream as the 4-rank reference."""
    out = tmp_path / "run"
    first_accum = "2" if before == 2 else "1"
    res = mpirun(before, "--out", out, "--ckpt-every", "5", "--stop-after", "10", "--grad-accum", first_accum)
    assert res.returncode == 0, res.stderr
    res = mpirun(after, "--out", out, "--ckpt-every", "5", "--resume", "latest", "--grad-accum", str(accum))
    assert res.returncode == 0, res.stderr
    assert f"written by {before} ranks, now {after}" in res.stdout and "logical digests verified" in res.stdout
    s = summary(out)
    assert s["start_step"] == 10 and s["final_step"] == 20 and all(v["ok"] for v in s["invariants"].values())
    ref, got = uninterrupted["by_step"], by_step(out)
    if before * int(first_accum) == 4 and after * accum == 4:
        for step in range(1, 21):
            assert got[step][0] == pytest.approx(ref[step][0], rel=1e-4, abs=1e-4), step
    else:  # another global batch: judged by the sample ranges, none repeated or skipped (a loss barely differs)
        with open(out / "metrics.jsonl") as f:
            ranges = {r["step"]: r["samples"] for r in map(json.loads, f) if "step" in r}
        g = after * accum * 4
        assert [ranges[s] for s in range(1, 21)] == [[16 * s, 16 * s + 16] for s in range(10)] + \
            [[160 + g * s, 160 + g * s + g] for s in range(10)]


def test_incompatible_config_is_refused(tmp_path):
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--steps", "4", "--ckpt-every", "2").returncode == 0
    res = mpirun(2, "--out", out, "--steps", "8", "--resume", "latest", "--d-model", "64")
    assert res.returncode == 2 and "MPI_ABORT" not in res.stderr   # the flags' mistake: a usage error
    assert "incompatible" in res.stderr and "d_model is 32 in the checkpoint but 64 in this run" in res.stderr


@pytest.mark.parametrize("point, rank", [("before_data", 1), ("after_data", 2), ("before_rename", 3),
                                         ("before_rename", 0), ("before_pointer", 0)])
def test_kill_during_save_then_resume_latest(tmp_path, uninterrupted, point, rank):
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--ckpt-every", "5", env_extra={"CAPSTONE_FAULT": f"{point}:{rank}:10"})
    assert res.returncode != 0 and f"killing this rank at save.{point} of step 10" in res.stderr
    ckpts = out / "checkpoints"
    assert files.read_pointer(str(ckpts)).endswith(files.final_name(5)), "latest still names the previous checkpoint"
    verify = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", str(ckpts / files.final_name(5))],
                            capture_output=True, text=True, env=mpi_env())
    assert verify.returncode == 0, verify.stdout
    res = mpirun(4, "--out", out, "--ckpt-every", "5", "--resume", "latest")
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert s["resumed_from"].endswith(files.final_name(5))
    assert s["final_param_fingerprint"] == uninterrupted["final_param_fingerprint"]
    assert not [p for p in os.listdir(ckpts) if ".partial-" in p], "leftover partial files are cleaned up"


def test_kill_between_the_two_renames_of_a_publish(tmp_path, uninterrupted):
    """Rank 0 dies after publishing the digest file of checkpoint 10 and before renaming the file
    itself: no checkpoint is ever visible without its digest file (catches: the file renamed
    first), latest still names 5, and the resumed run removes the orphan digest and ends as the
    uninterrupted one."""
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--ckpt-every", "5", env_extra={"CAPSTONE_FAULT": "between_renames:0:10"})
    assert res.returncode != 0 and "killing this rank at publish.between_renames of step 10" in res.stderr
    ckpts = out / "checkpoints"
    published = sorted(p.name for p in ckpts.glob("ckpt-*.h5"))
    assert published == [files.final_name(5)] and (ckpts / (files.final_name(10) + ".sha256")).exists()
    assert all((ckpts / (name + ".sha256")).exists() for name in published)
    assert files.read_pointer(str(ckpts)).endswith(files.final_name(5))
    res = mpirun(4, "--out", out, "--ckpt-every", "5", "--resume", "latest")
    assert res.returncode == 0, res.stderr
    assert summary(out)["final_param_fingerprint"] == uninterrupted["final_param_fingerprint"]
    assert sorted(p.name for p in ckpts.glob("*.sha256")) == sorted(p.name + ".sha256" for p in ckpts.glob("ckpt-*.h5"))


def test_corrupt_latest_is_rejected_by_resume_and_verify(tmp_path):
    out = tmp_path / "run"
    assert mpirun(4, "--out", out, "--steps", "4", "--ckpt-every", "2").returncode == 0
    path = files.read_pointer(str(out / "checkpoints"))
    flip_shard_byte(path, 2, 100, 0x80)
    res = mpirun(4, "--out", out, "--steps", "6", "--resume", "latest", timeout=60)
    assert res.returncode == 1  # the whole-file digest, before HDF5 parses the file
    assert res.stderr.count(f"not a valid checkpoint: {path}: its sha256 is") == 1 and "--resume auto" in res.stderr
    verify = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", path],
                            capture_output=True, text=True, env=mpi_env())
    assert verify.returncode == 1 and "not a valid checkpoint" in verify.stderr
    integrity.write_digest(path)  # as if damaged before it was hashed: the shard's own digest catches it
    res = mpirun(4, "--out", out, "--steps", "6", "--resume", "latest", timeout=60)
    assert res.returncode == 1 and "MPI_ABORT" not in res.stderr
    assert path in res.stderr and "/shards/rank00002" in res.stderr and "rank 2" in res.stderr
    verify = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", path],
                            capture_output=True, text=True, env=mpi_env())
    assert verify.returncode == 1 and "BAD /shards/rank00002" in verify.stdout
    os.truncate(path, 4096)
    verify = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", path],
                            capture_output=True, text=True, env=mpi_env())
    assert verify.returncode == 1 and "truncated" in verify.stderr


def test_resume_latest_without_checkpoint_says_what_to_do(tmp_path):
    res = mpirun(2, "--out", tmp_path / "run", "--resume", "latest", timeout=60)
    assert res.returncode == 2 and "no complete checkpoint" in res.stderr and "--resume auto" in res.stderr


def test_sigusr1_checkpoints_at_step_boundary_and_resume_finishes(tmp_path, uninterrupted):
    out = tmp_path / "run"
    cmd = ["mpirun", "-n", "4", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", str(out),
           "--ckpt-every", "5", "--sleep-per-step", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=ROOT)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count('"step"') < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # mpirun forwards SIGUSR1 to every rank
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    s = summary(out)
    assert s["status"] == "preempted" and 3 <= s["final_step"] < 20
    assert files.read_pointer(str(out / "checkpoints")).endswith(files.final_name(s["final_step"]))
    res = mpirun(4, "--out", out, "--ckpt-every", "5", "--resume", "latest")
    assert res.returncode == 0, res.stderr
    assert summary(out)["final_param_fingerprint"] == uninterrupted["final_param_fingerprint"]


def test_wall_clock_checkpoints(tmp_path):
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", "8", "--ckpt-every", "0", "--ckpt-every-minutes", "0.005",
                 "--sleep-per-step", "0.25")
    assert res.returncode == 0, res.stderr
    saved = [c["step"] for c in summary(out)["checkpoints"]]
    assert len(saved) >= 3 and saved[-1] == 8, saved  # every ~0.3 s of wall clock, plus the final one


def test_resume_past_the_last_step_says_what_to_do(tmp_path):
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--steps", "4", "--ckpt-every", "2").returncode == 0
    res = mpirun(2, "--out", out, "--steps", "4", "--resume", "latest", timeout=60)
    assert res.returncode == 2 and "nothing left to do" in res.stderr and "--steps larger than 4" in res.stderr
    res = mpirun(2, "--out", out, "--steps", "6", "--resume", "latest", "--lr", "0.005")
    assert res.returncode == 0, res.stderr
    assert "resuming with changed settings:" in res.stdout and "lr: 0.01 -> 0.005" in res.stdout
    assert summary(out)["final_step"] == 6


def test_kill_during_the_first_save_then_resume_auto(tmp_path, uninterrupted):
    """Killed after the first checkpoint was renamed into place but before `latest` existed:
    --resume auto (what the batch script uses) takes the newest complete file."""
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--ckpt-every", "5", env_extra={"CAPSTONE_FAULT": "before_pointer:0:5"})
    assert res.returncode != 0
    assert sorted(os.listdir(out / "checkpoints")) == [files.final_name(5), files.final_name(5) + ".sha256"]
    res = mpirun(4, "--out", out, "--ckpt-every", "5", "--resume", "auto")
    assert res.returncode == 0, res.stderr
    s = summary(out)
    assert s["resumed_from"].endswith(files.final_name(5))
    assert s["final_param_fingerprint"] == uninterrupted["final_param_fingerprint"]


def test_resume_from_an_older_checkpoint_never_replaces_newer_ones(tmp_path):
    out, branch = tmp_path / "run", tmp_path / "branch"
    assert mpirun(2, "--out", out, "--steps", "6", "--ckpt-every", "2").returncode == 0
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    older = out / "checkpoints" / files.final_name(2)
    res = mpirun(2, "--out", out, "--steps", "6", "--resume", older, timeout=60)
    assert res.returncode == 2 and "would replace them" in res.stderr and "ckpt-00000004.h5" in res.stderr
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before
    res = mpirun(2, "--out", branch, "--steps", "6", "--resume", older)
    assert res.returncode == 0, res.stderr
    assert summary(branch)["start_step"] == 2


def test_bad_pointer_and_missing_dataset_are_clean_errors(tmp_path):
    out = tmp_path / "run"
    assert mpirun(3, "--out", out, "--steps", "4", "--ckpt-every", "2").returncode == 0
    pointer = out / "checkpoints" / "latest"
    good = pointer.read_text()
    pointer.write_text("../../etc/passwd\n")
    res = mpirun(3, "--out", out, "--steps", "6", "--resume", "latest", timeout=60)
    assert res.returncode == 2 and "not a checkpoint file name" in res.stderr and "MPI_ABORT" not in res.stderr
    pointer.write_text(good)
    import h5py
    with h5py.File(out / "checkpoints" / good.strip(), "r+") as f:
        del f["shards/rank00001"]
    integrity.write_digest(str(out / "checkpoints" / good.strip()))  # else the whole-file digest refuses it first
    res = mpirun(3, "--out", out, "--steps", "6", "--resume", "latest", timeout=60)
    assert res.returncode == 1 and "/shards/rank00001 is missing (needed by rank 1)" in res.stderr
    assert "MPI_ABORT" not in res.stderr and "aborting" not in res.stderr, res.stderr
    assert res.stderr.count("is missing (needed by rank 1)") == 1, res.stderr   # said once, by rank 0


def test_resume_latest_with_a_mistyped_out_creates_nothing(tmp_path):
    res = mpirun(2, "--out", tmp_path / "typo", "--resume", "latest", timeout=60)
    assert res.returncode == 2 and not (tmp_path / "typo").exists()


def test_write_error_on_one_rank_fails_cleanly_and_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    """A full disk on one node while it writes its shard: every rank stops with the message
    (no hang in the file's collective close), `latest` still names the previous checkpoint."""
    out = tmp_path / "run"
    res = mpirun(4, "--out", out, "--ckpt-every", "5", env_extra={"CAPSTONE_FAULT": "write_error:2:10"}, timeout=90)
    assert res.returncode == 1
    assert res.stderr.count("rank 2 could not write its shard of checkpoint step 10") == 1
    assert "No space left on device" in res.stderr and "MPI_ABORT" not in res.stderr
    assert files.read_pointer(str(out / "checkpoints")).endswith(files.final_name(5))
    res = mpirun(4, "--out", out, "--ckpt-every", "5", "--resume", "latest")
    assert res.returncode == 0, res.stderr
    assert summary(out)["final_param_fingerprint"] == uninterrupted["final_param_fingerprint"]
    assert not [p for p in os.listdir(out / "checkpoints") if ".partial-" in p]


def test_resume_with_other_data_settings_is_refused(tmp_path):
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--steps", "4", "--ckpt-every", "2").returncode == 0
    res = mpirun(2, "--out", out, "--steps", "6", "--resume", "latest", "--corpus-seed", "1", timeout=60)
    assert res.returncode == 2 and "corpus_seed is 0 in the checkpoint but 1 in this run" in res.stderr
