"""Asynchronous checkpoints (--ckpt-async, the default) under the faults a synchronous save survives:
kill -9 at random moments of a run that saves every step, a stop request while a write is in
flight. (A full disk during an asynchronous write: tests/test_disk_full.py, in both modes.)"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from capstone.checkpoint import files

from conftest import by_step, launch, mpi_env, mpirun, summary

# a model whose checkpoint (about 10 MB on 2 ranks) takes a while to hash and write, saved every step
FLAGS = ["--steps", 10, "--ckpt-every", 1, "--keep-last", 2, "--d-model", 128, "--n-layers", 4]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run (made once for this module)."""
    out = tmp_path_factory.mktemp("async") / "whole"
    res = mpirun(2, "--out", out, *FLAGS)
    assert res.returncode == 0, res.stderr
    return out


def steps_logged(out) -> int:
    try:
        return (out / "metrics.jsonl").read_text().count('"step"')
    except OSError:
        return 0


def writing(ckpts) -> bool:
    """Whether a checkpoint file is being written now (its partial file exists)."""
    try:
        return any(".h5.partial-" in n for n in os.listdir(ckpts))
    except OSError:
        return False


def verified(path) -> bool:
    res = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", str(path)],
                         capture_output=True, text=True, env=mpi_env())
    return res.returncode == 0


def killed_launch(out, pids, rng) -> tuple[int, bool]:
    """One launch of `--resume auto`, a rank SIGKILLed after a random number of its steps: at once
    when a write is seen in flight (mid-write), or after a random fraction of a step. Returns the
    job's exit status and whether the kill landed while a partial file existed."""
    for f in pids.iterdir():
        f.unlink()
    before = steps_logged(out)
    job = launch(2, "--out", out, *FLAGS, "--resume", "auto", env_extra={"CAPSTONE_FAULT_PIDS": str(pids)})
    try:
        target, mid_write = before + rng.randint(1, 4), rng.random() < 0.5
        deadline = time.time() + 120
        while time.time() < deadline and job.poll() is None and steps_logged(out) < target:
            time.sleep(0.01)
        until = time.time() + (1.0 if mid_write else rng.uniform(0.0, 0.3))
        while time.time() < until and job.poll() is None and not (mid_write and writing(out / "checkpoints")):
            time.sleep(0.001)
        during = writing(out / "checkpoints")
        if job.poll() is None and len(list(pids.iterdir())) == 2:
            os.kill(int((pids / str(rng.randrange(2))).read_text()), signal.SIGKILL)
        job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    return job.returncode, during


def test_kill_9_at_random_moments_of_async_writes_then_resume_auto_is_bit_identical(tmp_path, whole):
    """A run checkpointing every step in the background is killed (SIGKILL to a random rank) at random
    moments, half of them the moment a write is seen in flight, then resumed with --resume auto, four
    times: after every kill `latest` names a complete checkpoint that verifies, and the run that
    finishes at last is bit-identical, step by step, to the uninterrupted one."""
    seed = int(os.environ.get("CAPSTONE_TEST_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    kills, mid_write = 0, 0
    for _ in range(4):
        code, during = killed_launch(out, pids, rng)
        if code == 0:   # it finished before the kill
            break
        kills, mid_write = kills + 1, mid_write + during
        pointed = files.read_pointer(str(out / "checkpoints"))
        assert pointed is None or verified(pointed), f"seed {seed}: latest {pointed} does not verify"
    res = mpirun(2, "--out", out, *FLAGS, "--resume", "auto")
    assert res.returncode == 0, f"seed {seed}: " + res.stderr[-2000:]
    assert kills >= 2, f"seed {seed}: only {kills} launches were killed"
    assert by_step(out) == by_step(whole), f"seed {seed}"
    assert summary(out)["final_param_fingerprint"] == summary(whole)["final_param_fingerprint"], f"seed {seed}"
    print(f"seed {seed}: {kills} kills, {mid_write} of them with a write in flight")


@pytest.mark.parametrize("how", ["SIGUSR1 to mpirun", "Ctrl-C"])
def test_a_stop_during_an_async_write_waits_for_it_then_saves(tmp_path, whole, how):
    """SIGUSR1 to mpirun, or a Ctrl-C (SIGINT to mpirun's process group, under scripts/env.sh's kill
    sequence), the moment a background write is seen in flight: that write completes and is
    published, the stop then saves its own checkpoint as a synchronous run does (status preempted,
    the ranks exit 0, `latest` names the stop's step), every checkpoint left verifies, and --resume
    latest finishes bit-identical to the uninterrupted run."""
    for attempt in range(3):   # on a loaded machine the poll can miss every write window of a launch: again
        out = tmp_path / f"run{attempt}"
        job = launch(2, "--out", out, *FLAGS, "--sleep-per-step", 0.2)
        deadline = time.time() + 120
        while time.time() < deadline and job.poll() is None and not writing(out / "checkpoints"):
            time.sleep(0.001)
        if writing(out / "checkpoints"):
            break
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    try:
        assert writing(out / "checkpoints"), "no write was seen in flight in 3 launches"
        if how == "Ctrl-C":
            os.killpg(job.pid, signal.SIGINT)   # as a terminal sends it
        else:
            job.send_signal(signal.SIGUSR1)     # mpirun forwards it to every rank
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode == (1 if how == "Ctrl-C" else 0), stderr   # mpirun exits 1 once interrupted
    s = summary(out)
    step, saved = s["final_step"], [c["step"] for c in s["checkpoints"]]
    assert s["status"] == "preempted" and saved[-1] == step and all(v["ok"] for v in s["invariants"].values())
    path = out / "checkpoints" / files.final_name(step)
    assert f"stopped at step {step} on " in stdout and f": saved checkpoint {path}" in stdout
    assert files.read_pointer(str(out / "checkpoints")).endswith(files.final_name(step))
    assert not writing(out / "checkpoints") and all(verified(c["path"]) for c in s["checkpoints"][-2:])
    res = mpirun(2, "--out", out, *FLAGS, "--resume", "latest")
    assert res.returncode == 0, res.stderr
    assert by_step(out) == by_step(whole)
