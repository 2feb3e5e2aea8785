"""Stopping a run: a signal to one rank stops every rank at a step boundary; Ctrl-C, SIGTERM to
mpirun or to the ranks save a checkpoint that --resume continues; Ctrl-Z then fg carries on."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from capstone.checkpoint import files

from conftest import ROOT, children, launch, mpi_env, mpirun, summary, wait_for_steps


def find_rank_pid(tag: str, rank: int, timeout: float = 30) -> int:
    """pid of the rank process whose environment holds CAPSTONE_TEST_TAG=tag (set for this job only)."""
    want = {f"CAPSTONE_TEST_TAG={tag}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if want <= set(f.read().split(b"\0")):
                        return int(pid)
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} process with tag {tag}")


@pytest.mark.parametrize("sig, rank, mode", [(signal.SIGUSR1, 2, ()), (signal.SIGTERM, 1, ()),
                                             (signal.SIGUSR1, 1, ("--deterministic",)),
                                             (signal.SIGUSR1, 2, ("--pp", "2", "--grad-accum", "2"))],
                         ids=["usr1", "term", "usr1-deterministic", "usr1-pipeline"])
def test_a_signal_to_one_rank_stops_every_rank_at_a_step_boundary(tmp_path, sig, rank, mode):
    """SIGUSR1 or SIGTERM delivered to ONE rank (not rank 0, not through mpirun), in the default and
    the deterministic mode (its own reduction carries the flags) and a pipeline (rank 2: stage 0
    of the second replica): all ranks agree to checkpoint at the next step, the run ends
    'preempted' with exit 0 (catches: a stop request honoured on rank 0 only, SIGTERM not
    handled, or a mode that drops the agreed flag)."""
    out, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = ["mpirun", "-n", "4" if "--pp" in mode else "3", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", str(out),
           "--steps", "40", "--ckpt-every", "0", "--sleep-per-step", "0.2", *mode]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**mpi_env(), "CAPSTONE_TEST_TAG": tag}, cwd=ROOT)
    try:
        pid = find_rank_pid(tag, rank)
        deadline = time.time() + 60
        while time.time() < deadline and (not (out / "metrics.jsonl").exists()
                                          or (out / "metrics.jsonl").read_text().count('"step"') < 2):
            time.sleep(0.05)
        os.kill(pid, sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    s = summary(out)
    assert s["status"] == "preempted" and 2 <= s["final_step"] < 40, s["final_step"]
    assert [c["step"] for c in s["checkpoints"]] == [s["final_step"]]
    assert files.read_pointer(str(out / "checkpoints")).endswith(files.final_name(s["final_step"]))
    assert f"stopped at step {s['final_step']}" in stdout


def verify(path):
    return subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", str(path)],
                          capture_output=True, text=True, env=mpi_env())


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


def test_a_stop_at_the_last_step_completes_the_run(tmp_path):
    """A stop asked for at the last step (--stop-after equal to --steps) has nothing left to save
    for: the run completes, exit 0, status "completed", and says nothing of a stop (catches: a
    finished run reported as preempted, which a batch script would requeue)."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", "4", "--stop-after", "4", "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary(out)["status"] == "completed" and "stopped at step" not in res.stdout


def catches(pid: int, sig: int) -> bool:
    """Whether process pid has a handler for sig (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def test_a_sigusr1_while_the_ranks_start_stops_the_run_before_its_first_step(tmp_path):
    """`kill -USR1 <mpirun pid>` (docs/running.md's way to stop a run) as soon as both ranks catch it,
    while they still load NumPy and MPI: the run stops before its first step, saves step 0, ends
    "preempted" with exit 0, and (b) says it had nothing to compare (catches: (b) failing the run
    at 0 of 0 steps, which a batch script's requeue would not restart); --resume latest continues."""
    out, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "capstone.train", "--out", str(out), "--steps", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**mpi_env(), "CAPSTONE_TEST_TAG": tag}, cwd=ROOT)
    try:
        ranks = [find_rank_pid(tag, r) for r in (0, 1)]
        deadline = time.time() + 30
        while time.time() < deadline and not all(catches(pid, signal.SIGUSR1) for pid in ranks):
            time.sleep(0.005)
        proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout + stderr
    s = summary(out)
    assert s["status"] == "preempted" and s["final_step"] == 0, stdout
    assert "(b) not judged: the launch stopped before its first step" in stdout and "FAILED" not in stdout
    assert "(a) not judged" in stdout and "over 0 evaluations" not in stdout, stdout   # no figures of nothing
    res = mpirun(2, "--out", out, "--steps", "6", "--resume", "latest")
    assert res.returncode == 0 and summary(out)["final_step"] == 6, res.stdout + res.stderr


def test_the_stop_handlers_are_in_place_before_numpy_and_mpi_load():
    """`python -m capstone.train` installs its stop handlers before it imports NumPy or mpi4py (under
    mpirun that import and MPI's start take seconds; SIGUSR1's default action would kill the rank)."""
    spy = ("import runpy, signal, sys\n"
           "seen = {}\n"
           "class Spy:\n"
           "    def find_spec(self, name, path=None, target=None):\n"
           "        if name in ('numpy', 'mpi4py'):\n"
           "            seen.setdefault(name, getattr(signal.getsignal(signal.SIGUSR1), '__module__', None))\n"
           "sys.meta_path.insert(0, Spy())\n"
           "sys.argv = ['capstone.train', '--help']\n"
           "try:\n"
           "    runpy.run_module('capstone.train', run_name='__main__', alter_sys=True)\n"
           "except SystemExit:\n"
           "    pass\n"
           "print('SEEN', seen)\n")
    res = subprocess.run([sys.executable, "-c", spy], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                         timeout=120)
    seen = res.stdout.rsplit("SEEN", 1)[-1].strip()
    assert seen == str({"numpy": "capstone.runtime.signals", "mpi4py": "capstone.runtime.signals"}), res.stdout + res.stderr
