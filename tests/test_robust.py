"""Hardening for real runs (issue 9), each against the real failure: a really full disk (a small
tmpfs), real permission denials (root without CAP_DAC_OVERRIDE), a second job on the same run
directory and a kill -9, real signals to mpirun and to the ranks, scripts/run from elsewhere."""

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from conftest import ROOT, mpi_env, mpirun, summary

from capstone.checkpoint import files

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


def launch(n, *args, env_extra=None):
    """mpirun as scripts/run starts it (scripts/env.sh sourced), in the background."""
    env = {k: v for k, v in mpi_env().items() if k != "OMPI_MCA_odls_base_sigkill_timeout"}  # env.sh's 3 s
    env.update(CAPSTONE_VENV=sys.prefix, **(env_extra or {}))
    cmd = ["bash", "-c", 'source "$0/scripts/env.sh" && exec "${MPIRUN[@]}" "$@"', ROOT, "-n", str(n),
           "python", "-m", "capstone.train", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def wait_for_steps(out, n, timeout=60):
    metrics = out / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count('"step"') < n):
        time.sleep(0.05)
    assert metrics.read_text().count('"step"') >= n


def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found


def verify(path):
    return subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", str(path)],
                          capture_output=True, text=True, env=mpi_env())


def unprivileged_root(*args, **kw):
    """Root without the capabilities that bypass file permissions: chmod is enforced for real."""
    env = mpi_env()
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "mpirun", "-n", "2", "--oversubscribe",
           sys.executable, "-m", "capstone.train", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT, **kw)


# --- 4: a full disk during a save ----------------------------------------------------------------

@ROOT_ONLY
def test_disk_full_during_a_save_fails_fast_and_keeps_the_previous_checkpoint(tmp_path):
    """The 600 KB disk holds one checkpoint: the save at step 10 hits ENOSPC mid-write (the
    free-space check is off, so HDF5 really writes). Every rank stops within seconds with one
    message, the partial file is gone and gives its space back, `latest` still names step 5."""
    with tmpfs(tmp_path / "disk") as disk:
        out = disk / "run"
        t0 = time.time()
        res = mpirun(2, "--out", out, "--ckpt-every", "5", timeout=90, env_extra={"CAPSTONE_CHECK_SPACE": "0"})
        elapsed = time.time() - t0
        assert res.returncode == 1, res.stderr
        assert res.stderr.count("of checkpoint step 10 to") == 1 and "MPI_ABORT" not in res.stderr
        assert "could not write" in res.stderr and "The partial file was removed" in res.stderr
        assert elapsed < 30, f"took {elapsed:.1f} s"
        ckpts = out / "checkpoints"
        assert sorted(os.listdir(ckpts)) == [files.final_name(5), files.final_name(5) + ".sha256", "latest"]
        assert files.read_pointer(str(ckpts)).endswith(files.final_name(5))
        assert verify(ckpts / files.final_name(5)).returncode == 0
        assert shutil.disk_usage(disk).free > 200_000, "the partial file's space was given back"


@ROOT_ONLY
def test_a_checkpoint_that_cannot_fit_is_refused_before_writing(tmp_path):
    with tmpfs(tmp_path / "disk") as disk:
        out = disk / "run"
        res = mpirun(2, "--out", out, "--ckpt-every", "5", timeout=90)
        assert res.returncode == 1, res.stderr
        assert res.stderr.count("not enough space for checkpoint step 10") == 1, res.stderr
        assert "Nothing was written" in res.stderr and "mca_fbtl" not in res.stderr
        assert sorted(os.listdir(out / "checkpoints")) == [files.final_name(5), files.final_name(5) + ".sha256", "latest"]


# --- 5 and 17: start-up checks; a failed start leaves nothing --------------------------------------

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
    assert res.returncode == 1 and "incompatible" in res.stderr
    assert not (tmp_path / "a").exists(), "the failed start removed the directories it created"


def test_batch_too_large_for_memory_is_refused_with_the_estimate(tmp_path):
    res = mpirun(2, "--out", tmp_path / "run", "--batch-size", "100000", timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("--batch-size 100000 needs about") == 1 and "MiB is available" in res.stderr
    assert not (tmp_path / "run").exists()


# --- 6: one run per --out ---------------------------------------------------------------------------

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
        assert f"launched by pid {first.pid}" in second.stderr and refused_in < 20
    finally:
        for pid in children(first.pid) + [first.pid]:   # kill -9 the ranks and mpirun: no cleanup at all
            os.kill(pid, signal.SIGKILL)
        first.communicate()
    third = mpirun(2, "--out", out, "--steps", "60", "--resume", "auto")
    assert third.returncode == 0, third.stderr
    start = summary(out)["start_step"]
    assert start >= 5 and start % 5 == 0 and summary(out)["resumed_from"].endswith(files.final_name(start))


# --- 7: Ctrl-C, kill -TERM, SIGINT to the ranks ------------------------------------------------------

@pytest.mark.parametrize("how", ["SIGINT to mpirun", "SIGTERM to mpirun", "SIGINT to the ranks"])
def test_interrupt_saves_a_checkpoint_that_resume_continues(tmp_path, how):
    """A 1.5 s step (--sleep-per-step) and no periodic checkpoint: the stop itself must save."""
    out = tmp_path / "run"
    proc = launch(2, "--out", out, "--steps", "100", "--ckpt-every", "0", "--sleep-per-step", "1.5")
    wait_for_steps(out, 2)
    sig = signal.SIGTERM if "TERM" in how else signal.SIGINT
    t0 = time.time()
    for pid in children(proc.pid) if "ranks" in how else [proc.pid]:
        os.kill(pid, sig)
    stdout, stderr = proc.communicate(timeout=60)
    elapsed = time.time() - t0
    s = summary(out)
    step = s["final_step"]
    assert s["status"] == "preempted" and 2 <= step < 100, stderr
    path = out / "checkpoints" / files.final_name(step)
    assert f"stopped at step {step} on " in stdout and f"saved checkpoint {path}" in stdout
    assert stderr.count("saving a checkpoint at the end of this step") == 1
    assert files.read_pointer(str(out / "checkpoints")) == str(path) and verify(path).returncode == 0
    assert proc.returncode == (0 if "ranks" in how else 1), stderr  # mpirun exits 1 once it is interrupted
    assert elapsed < 15, f"{how}: {elapsed:.1f} s from the signal to the exit"
    if how != "SIGTERM to mpirun":
        return  # resuming is the same for all three; once is enough
    res = mpirun(2, "--out", out, "--steps", str(step + 2), "--resume", "latest")
    assert res.returncode == 0, res.stderr
    assert summary(out)["start_step"] == step and summary(out)["final_step"] == step + 2


def test_ctrl_z_then_fg_does_not_stop_the_run(tmp_path):
    """Ctrl-Z reaches the ranks as SIGSTOP and fg as SIGCONT, the same SIGCONT that starts mpirun's
    kill sequence: after a real stop the run must carry on."""
    out = tmp_path / "run"
    proc = launch(2, "--out", out, "--steps", "100", "--ckpt-every", "0", "--sleep-per-step", "0.1")
    wait_for_steps(out, 3)
    proc.send_signal(signal.SIGTSTP)
    time.sleep(1.5)
    proc.send_signal(signal.SIGCONT)
    steps = (out / "metrics.jsonl").read_text().count('"step"')
    wait_for_steps(out, steps + 5)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "on SIGUSR1" in stdout, stderr


# --- 15: scripts/run keeps the caller's directory -----------------------------------------------------

def test_scripts_run_writes_a_relative_out_under_the_callers_directory(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = mpi_env()
    env.update(CAPSTONE_VENV=sys.prefix, NP="2")
    res = subprocess.run([os.path.join(ROOT, "scripts", "run"), "--out", "rel-r9test", "--steps", "2", "--quiet"],
                         capture_output=True, text=True, env=env, cwd=elsewhere, timeout=120)
    assert res.returncode == 0, res.stderr
    assert (elsewhere / "rel-r9test" / "summary.json").exists()
    assert not os.path.exists(os.path.join(ROOT, "rel-r9test"))
