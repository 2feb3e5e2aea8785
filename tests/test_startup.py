"""What a start refuses before anything is trained or written, each against the real failure: an
h5py without MPI, an unwritable run directory (root without CAP_DAC_OVERRIDE), a checkpoint that
cannot fit, a batch that cannot fit in memory, a second run on the same directory, a corpus too short."""

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from capstone.checkpoint import files

from conftest import ROOT, children, launch, mpi_env, mpirun, summary, wait_for_steps


def test_h5py_without_mpi_refuses_more_than_one_rank_at_startup(tmp_path):
    """The start-up refusal end to end (h5py reporting no MPI support): exit 2 on every rank with
    one message, before anything is written (catches: the refusal skipped; training would run and
    fail at the first save)."""
    out = tmp_path / "run"
    code = ("import sys, capstone.checkpoint as c; c.mpi_io_available = lambda: False; "
            "from capstone.train import main; main(sys.argv[1:])")
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-c", code, "--out", str(out), "--steps", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=mpi_env(), cwd=ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("h5py has no MPI support") == 1 and "MPI_ABORT" not in res.stderr
    assert not out.exists()


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, setpriv)")


@contextmanager
def tmpfs(path, size="600k"):
    """A small filesystem of its own at `path`, unmounted whatever happens."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)]).returncode != 0:
            subprocess.run(["umount", "-l", str(path)])


def unprivileged_root(*args, **kw):
    """Root without the capabilities that bypass file permissions: chmod is enforced for real."""
    env = mpi_env()
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "mpirun", "-n", "2", "--oversubscribe",
           sys.executable, "-m", "capstone.train", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, **kw)


@ROOT_ONLY
def test_a_checkpoint_that_cannot_fit_is_refused_before_writing(tmp_path):
    with tmpfs(tmp_path / "disk") as disk:
        out = disk / "run"
        res = mpirun(2, "--out", out, "--ckpt-every", "5", timeout=90)
        assert res.returncode == 1, res.stderr
        assert res.stderr.count("not enough space for checkpoint step 10") == 1, res.stderr
        assert "Nothing was written" in res.stderr and "mca_fbtl" not in res.stderr
        assert sorted(os.listdir(out / "checkpoints")) == [files.final_name(5), files.final_name(5) + ".sha256", "latest"]


@ROOT_ONLY
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("case", ["checkpoints", "parent"])
def test_unwritable_run_directory_is_refused_before_training(tmp_path, case):
    locked = tmp_path / "locked"
    locked.mkdir()
    out = tmp_path / "run" if case == "checkpoints" else locked / "run"
    if case == "checkpoints":
        (out / "checkpoints").mkdir(parents=True)
        locked = out / "checkpoints"
    locked.chmod(0o555)
    try:
        res = unprivileged_root("--out", out, "--steps", "12")
    finally:
        locked.chmod(0o755)
    assert res.returncode == 2, res.stderr
    said = f"{out / 'checkpoints'} is not writable" if case == "checkpoints" else f"cannot create the run directory {out}"
    assert res.stderr.count(said) == 1 and "Permission denied" in res.stderr, res.stderr
    assert "MPI_ERR_ACCESS" not in res.stderr and "Traceback" not in res.stderr
    assert "step" not in res.stdout, "nothing was trained"
    assert (sorted(os.listdir(out)) == ["checkpoints"]) if case == "checkpoints" else not out.exists()


def test_failed_resume_into_a_new_out_leaves_no_directories(tmp_path):
    src, branch = tmp_path / "src", tmp_path / "a" / "b" / "branch"
    assert mpirun(2, "--out", src, "--steps", "2", "--ckpt-every", "2").returncode == 0
    res = mpirun(2, "--out", branch, "--resume", src / "checkpoints" / files.final_name(2), "--d-model", "64",
                 timeout=60)
    assert res.returncode == 2 and "incompatible" in res.stderr
    assert not (tmp_path / "a").exists(), "the failed start removed the directories it created"


def test_batch_too_large_for_memory_is_refused_with_the_estimate(tmp_path):
    res = mpirun(2, "--out", tmp_path / "run", "--batch-size", "100000", timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("--batch-size 100000 at --seq-len") == 1 and "MiB is available" in res.stderr
    assert not (tmp_path / "run").exists()


def test_second_run_on_the_same_out_is_refused_and_a_killed_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    first = launch(2, "--out", out, "--steps", "60", "--ckpt-every", "5", "--sleep-per-step", "0.3")
    try:
        wait_for_steps(out, 6)
        t0 = time.time()
        second = mpirun(2, "--out", out, "--steps", "60", "--resume", "auto", timeout=60)
        refused_in = time.time() - t0
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("another run is using --out") == 1
        # the documented stop (docs/cluster.md): without --batch, a job run by mpirun (CAPSTONE_LAUNCHER=mpirun)
        # on one node has no step to signal, and the advice did nothing
        assert "scancel --signal=USR1 --batch <its job id>" in second.stderr, second.stderr
        assert f"launched by pid {first.pid}" in second.stderr and refused_in < 20
    finally:
        for pid in children(first.pid) + [first.pid]:   # kill -9 the ranks and mpirun: no cleanup at all
            os.kill(pid, signal.SIGKILL)
        first.communicate()
    third = mpirun(2, "--out", out, "--steps", "60", "--resume", "auto")
    assert third.returncode == 0, third.stderr
    start = summary(out)["start_step"]
    assert start >= 5 and start % 5 == 0 and summary(out)["resumed_from"].endswith(files.final_name(start))


def test_corpus_too_short_to_exist_is_a_config_error(tmp_path):
    res = mpirun(3, "--out", tmp_path / "run", "--corpus-tokens", 1, timeout=60)
    assert res.returncode == 2 and res.stderr.count("--corpus-tokens must be an integer >= 2") == 1
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


def test_a_model_that_fits_no_memory_is_refused_for_memory_before_disk_space(tmp_path):
    """Issue 53, item 7: `--d-model 100000 --n-layers 100` was refused for the disk space of its
    checkpoint, the smaller problem; a fresh start's memory is now judged first (the model is the
    flags'), with the fewest ranks that would fit or why none does; nothing is created."""
    out = tmp_path / "big"
    res = mpirun(2, "--d-model", 100000, "--n-layers", 100, "--out", out)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("error: ") == 1 and "MiB per rank" in res.stderr and "is available" in res.stderr
    assert "free but one checkpoint needs" not in res.stderr and "its model states alone take" in res.stderr
    assert not out.exists()
