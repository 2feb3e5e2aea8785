"""The job around a training step (capstone.runtime.job), what the batch scripts and scripts/launch
run, without Slurm: its refusals before the step starts (exit 2, nothing started, one line naming what
to change), the run directory's one-run rule, and the shell's share of it (scripts/slurm/step.sh
starts it, nothing more). Under Slurm and on several hosts: test_slurm.py, test_slurm_nodes.py,
test_multihost.py, test_ctrl_c.py."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT

STEP_SH = os.path.join(ROOT, "scripts", "slurm", "step.sh")


def job(*argv, env_extra=None, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CAPSTONE_"))}
    env.update(PYTHONPATH=ROOT, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "capstone.runtime.job", *map(str, argv)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=60)


@pytest.mark.parametrize("name, value", [("CAPSTONE_REQUEUE", "yes"), ("CAPSTONE_MAX_REQUEUES", "ten"),
                                         ("CAPSTONE_ABORT_GRACE", "-1"), ("CAPSTONE_MAX_RELAUNCHES", "three")])
def test_a_mistyped_switch_is_refused_before_the_step_starts(tmp_path, name, value):
    marker = tmp_path / "started"
    res = job(tmp_path / "run", "touch", marker, env_extra={name: value})
    assert res.returncode == 2 and not marker.exists(), res.stdout + res.stderr
    assert res.stdout.count("error: ") == 1 and f"{name}='{value}'" in res.stdout and "submit again" in res.stdout


def test_the_steps_out_must_be_the_watched_run_directory(tmp_path):
    marker = tmp_path / "started"
    other = job(tmp_path / "run", "sh", "-c", f"touch {marker}", "capstone.train", "--out", tmp_path / "elsewhere")
    assert other.returncode == 2 and "is not the run directory" in other.stdout and not marker.exists()
    none = job(tmp_path / "run", "python", "-m", "capstone.train", "--steps", 2)
    assert none.returncode == 2 and f"add --out {tmp_path / 'run'}" in none.stdout
    same = job(tmp_path / "run", "sh", "-c", f"touch {marker}", "capstone.train", f"--out={tmp_path / 'run'}")
    assert same.returncode == 0 and marker.exists() and "job step exited with status 0" in same.stdout


def test_the_steps_status_is_the_jobs_and_a_signal_is_said_as_a_shell_says_it(tmp_path):
    assert job(tmp_path, "sh", "-c", "exit 3").returncode == 3
    killed = job(tmp_path, "sh", "-c", "kill -TERM $$")
    assert killed.returncode == 143 and "job step exited with status 143" in killed.stdout


def test_a_launcher_that_is_not_there_is_said_once_with_a_shells_status(tmp_path):
    res = job(tmp_path, "no-such-launcher-x", "-n", 2)
    assert res.returncode == 127 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert res.stdout.count("error: ") == 1 and "no-such-launcher-x" in res.stdout


def test_a_first_start_refuses_a_default_run_directory_that_holds_a_run(tmp_path):
    held = tmp_path / "slurm-7"
    held.mkdir()
    (held / "metrics.jsonl").write_text("{}\n")
    res = job("make-run-dir", held, env_extra={"SLURM_JOB_ID": "7"})
    assert res.returncode == 2 and "already holds a run" in res.stdout and "CAPSTONE_RUN_DIR=" in res.stdout
    assert job("make-run-dir", held, env_extra={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}).returncode == 0
    (tmp_path / "file").write_text("")
    res = job("make-run-dir", tmp_path / "file" / "run")
    assert res.returncode == 2 and "cannot create the run directory" in res.stdout
    assert job("make-run-dir", tmp_path / "new" / "run").returncode == 0 and (tmp_path / "new" / "run").is_dir()


def test_the_shell_only_starts_the_job():
    """Issue 48, item 5: scripts/slurm/step.sh holds no product rule (it was 223 lines: argv parsing, the
    run directory's rule, the switches, summary.json read by an inline Python)."""
    text = open(STEP_SH).read()
    assert text.count("\n") <= 120
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    for rule in ("summary.json", "scontrol", "--out", "CAPSTONE_REQUEUE:-", "realpath", "import json"):
        assert rule not in code, rule


def test_a_relaunch_is_the_command_again_on_the_hosts_that_answer():
    """Issue 50 (capstone.runtime.relaunch): the host list and -n of the hosts that answer the probe (here a
    shell test of the host's name: h2 is "dead"), --resume auto required; srun's step inside the allocation."""
    from capstone.runtime import relaunch
    probe = {"CAPSTONE_HOST_PROBE": "sh -c 'test {host} != h2'"}
    cmd = ["mpirun", "-n", "4", "-H", "h1:2,h2:2", "python", "-m", "capstone.train", "--resume", "auto"]
    assert relaunch.command_again(cmd, probe) == (["mpirun", "-n", "2", "-H", "h1:2", *cmd[5:]], ["h2"])
    hosts = ["bash", "scripts/hosts", "mpirun", "--hosts", "h2:1,h1:1,h3:1", "--", "python", "--resume=auto"]
    assert relaunch.command_again(hosts, probe) == ([*hosts[:4], "h1:1,h3:1", *hosts[5:]], ["h2"])
    assert relaunch.command_again(cmd[:-2], probe) is None                     # no --resume auto: not resumable
    assert relaunch.command_again(cmd, {"CAPSTONE_HOST_PROBE": "false {host}"}) is None   # no host answers
    assert relaunch.command_again(["mpirun", "-n", "2", "python", "--resume", "auto"], probe) is None   # no list
