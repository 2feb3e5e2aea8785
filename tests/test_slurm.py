"""The Slurm path end to end, on a real single-node Slurm (scripts/slurm/local-slurm).

Run serially, NOT under mpirun (the jobs start their own MPI ranks through Slurm):

    python -m pytest tests/test_slurm.py

The module fixture starts the local cluster (as root on Debian it apt-installs slurm-wlm and munge
the first time). Without root / Debian / a working Slurm the tests are skipped with the reason,
unless CAPSTONE_REQUIRE_SLURM=1, which turns that skip into a failure (CI sets it).
The cluster is left running afterwards, so that later (or concurrent) sessions reuse it; stop it
with `scripts/slurm/local-slurm --stop`, or set CAPSTONE_SLURM_STOP=1 to stop it at the end when
this session started it (do not, while another session may still be using it).

What is proven:
  - the MPI plumbing: mpi4py ranks under `srun --mpi=pmix` and under `mpirun` inside an allocation;
  - (a) the shipped scripts/slurm/capstone.sbatch runs the reference experiment on 4 tasks and it
    completes with every invariant ok;
  - (b) preemption: SIGUSR1 to the batch shell (what `--signal=B:USR1@60` sends before the time
    limit) makes the job checkpoint and stop with status "preempted"; the job requeues itself and
    the requeued run resumes from `latest` and completes the run; and the same with requeueing off
    and a plain resubmission with the same CAPSTONE_RUN_DIR (through the mpirun launcher).
Every wait has a deadline; a job still alive when a test ends is cancelled.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL_SLURM = ROOT / "scripts" / "slurm" / "local-slurm"
SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "capstone.sbatch"
REQUIRE = os.environ.get("CAPSTONE_REQUIRE_SLURM") == "1"

if any(int(os.environ.get(k, "1") or 1) > 1 for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")):
    _WHY = "tests/test_slurm.py must run serially, not under mpirun (the jobs start their own ranks)"
    if REQUIRE:  # CI: an error, not a skip that reads as 'no tests ran'
        pytest.fail(f"{_WHY} (and CAPSTONE_REQUIRE_SLURM=1)", pytrace=False)
    pytest.skip(_WHY, allow_module_level=True)


def _unavailable(reason: str):
    if REQUIRE:
        pytest.fail(f"{reason} (and CAPSTONE_REQUIRE_SLURM=1)", pytrace=False)
    pytest.skip(reason)


def _venv() -> str:
    """The Python environment the jobs use: $CAPSTONE_VENV, else the one running pytest, else .venv."""
    if os.environ.get("CAPSTONE_VENV"):
        return os.environ["CAPSTONE_VENV"]
    if sys.prefix != sys.base_prefix:
        return sys.prefix
    return str(ROOT / ".venv")


@pytest.fixture(scope="module")
def slurm_conf():
    """Start (or reuse) the local Slurm; yields the path of its slurm.conf."""
    if not LOCAL_SLURM.exists():
        _unavailable(f"{LOCAL_SLURM} is missing")
    status = subprocess.run(["bash", str(LOCAL_SLURM), "--status"], capture_output=True, text=True, timeout=60)
    started = False
    if status.returncode == 0:
        out = status.stdout
    else:
        if os.geteuid() != 0:
            _unavailable("not root and no local Slurm is running: run `scripts/slurm/local-slurm` as root first")
        if not Path("/etc/debian_version").exists() and not shutil.which("slurmctld"):
            _unavailable("Slurm is not installed and this is not Debian/Ubuntu (local-slurm installs it with apt-get)")
        try:
            start = subprocess.run(["bash", str(LOCAL_SLURM)], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            _unavailable("scripts/slurm/local-slurm did not finish within 600 s")
        if start.returncode != 0:
            _unavailable("scripts/slurm/local-slurm could not start Slurm:\n" + start.stderr[-3000:])
        out, started = start.stdout, True
    m = re.search(r"^export SLURM_CONF=(\S+)$", out, re.M)
    if not m:
        _unavailable(f"scripts/slurm/local-slurm printed no `export SLURM_CONF=` line: {out!r}")
    yield m.group(1)
    if started and os.environ.get("CAPSTONE_SLURM_STOP") == "1":
        subprocess.run(["bash", str(LOCAL_SLURM), "--stop"], capture_output=True, text=True, timeout=120)


# ---- helpers ----------------------------------------------------------------------------------

def job_env(conf: str, **extra: str) -> dict:
    """The submitting environment: this one without Slurm/capstone leftovers, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "CAPSTONE_", "OMPI_", "PMIX_", "PMI_"))}
    env.update(SLURM_CONF=conf, CAPSTONE_VENV=_venv())
    env.update(extra)
    return env


def run(cmd, env, cwd=None, timeout=60, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def job_info(jid: str, env) -> dict:
    """`scontrol show job` as a dict (empty if Slurm no longer knows the job)."""
    try:
        p = run(["scontrol", "show", "job", "-o", jid], env, check=False, timeout=30)
    except subprocess.TimeoutExpired:   # slurmctld busy or gone: the caller's deadline decides
        return {}
    if p.returncode != 0:
        return {}
    return dict(kv.split("=", 1) for kv in p.stdout.split() if "=" in kv)


def submit(cwd: Path, env, *args: str) -> str:
    p = run(["sbatch", "--parsable", *args], env, cwd=cwd, timeout=60)
    return p.stdout.strip().split(";")[0]


def wait_until(what: str, predicate, timeout: float, interval: float = 0.25, diagnose=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{diagnose()}")


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def step_lines(run_dir: Path) -> int:
    """Number of per-step rows in metrics.jsonl (it also holds event rows such as 'start')."""
    try:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return 0
    return sum(1 for r in rows if "step" in r and "loss" in r)


def tail(path: Path, n: int = 60) -> str:
    try:
        return f"--- {path} (last {n} lines) ---\n" + "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return f"--- {path}: not readable ---"


def show(where: str, jid: str, info: dict, summary: dict | None) -> None:
    """One line for the CI log (pytest -rP): what Slurm and the run's summary.json say."""
    inv = {k: v.get("ok") for k, v in (summary or {}).get("invariants", {}).items()}
    print(f"{where}: job {jid} JobState={info.get('JobState')} ExitCode={info.get('ExitCode')} "
          f"Restarts={info.get('Restarts')} NumTasks={info.get('NumTasks')} | summary status="
          f"{(summary or {}).get('status')} start_step={(summary or {}).get('start_step')} "
          f"final_step={(summary or {}).get('final_step')} resumed_from={(summary or {}).get('resumed_from')} "
          f"invariants={inv}", flush=True)


def assert_invariants_ok(summary: dict, where: str):
    inv = summary.get("invariants")
    assert isinstance(inv, dict) and inv, f"{where}: summary has no invariants: {summary}"
    bad = {k: v for k, v in inv.items() if not (isinstance(v, dict) and v.get("ok") is True)}
    assert not bad, f"{where}: invariants not ok: {bad}"


@pytest.fixture
def jobs(slurm_conf):
    """Collects submitted job ids; cancels any that are still queued or running at the end."""
    ids: list[str] = []
    yield ids
    env = job_env(slurm_conf)
    for jid in ids:
        state = job_info(jid, env).get("JobState", "")
        if state in ("PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "CONFIGURING", "COMPLETING", "REQUEUE_HOLD"):
            try:
                run(["scancel", jid], env, check=False, timeout=30)
            except subprocess.TimeoutExpired:
                pass


def wait_finished(jid: str, env, timeout: float, out: Path, restarts: int = 0) -> dict:
    """Wait until the job is in a final state after at least `restarts` requeues."""
    final = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

    def done():
        info = job_info(jid, env)
        if info.get("JobState") in final and int(info.get("Restarts", 0)) >= restarts:
            return info
        return None
    return wait_until(f"job {jid} to finish (after {restarts} requeue(s))", done, timeout, interval=1.0,
                      diagnose=lambda: f"{job_info(jid, env)}\n{tail(out)}")


# ---- the infrastructure ---------------------------------------------------------------------

def test_local_slurm_is_idempotent(slurm_conf):
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(LOCAL_SLURM)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"export SLURM_CONF={slurm_conf}"
    assert time.monotonic() - t0 < 30, "a second start of a running cluster should be quick"
    env = job_env(slurm_conf)
    up = ("idle", "mixed", "allocated", "completing")  # completing: a job of an earlier run still ending
    assert run(["sinfo", "-h", "-o", "%T"], env).stdout.split()[0] in up
    listed = run(["srun", "--mpi=list"], env)
    assert "pmix" in listed.stdout + listed.stderr, "srun has no pmix MPI plugin"


HELLO = """\
from mpi4py import MPI
c = MPI.COMM_WORLD
print(f"hello {c.rank}/{c.size} sum={c.allreduce(c.rank)}", flush=True)
"""


@pytest.mark.parametrize("launcher", ["srun --mpi=pmix", "mpirun"])
def test_mpi_hello_world(slurm_conf, tmp_path, jobs, launcher):
    """mpi4py ranks form one communicator of 4 under both launchers (independent of capstone)."""
    (tmp_path / "hello.py").write_text(HELLO)
    python = Path(_venv()) / "bin" / "python"
    env = job_env(slurm_conf, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = f"{launcher} {'-n 4 ' if launcher == 'mpirun' else ''}{python} {tmp_path / 'hello.py'}"
    out = tmp_path / "hello.out"
    p = run(["sbatch", "--wait", "-n", "4", "-t", "5", "-o", out, "--wrap", cmd], env, cwd=tmp_path,
            timeout=150, check=False)
    log = out.read_text() if out.exists() else ""
    assert p.returncode == 0, f"{p.stdout}{p.stderr}\n{log}"
    # (ranks' lines may interleave in the log: match them anywhere)
    found = sorted(re.findall(r"hello (\d+)/(\d+) sum=(\d+)", log))
    assert found == [(str(r), "4", "6") for r in range(4)], log


# ---- (a) the reference experiment -------------------------------------------------------------

def test_reference_experiment_completes(slurm_conf, tmp_path, jobs):
    """`sbatch --wait scripts/slurm/capstone.sbatch` with the shipped defaults (4 tasks, srun)."""
    (tmp_path / "runs").mkdir()   # the script's --output=runs/slurm-%j.out needs it
    env = job_env(slurm_conf)
    p = run(["sbatch", "--wait", "--parsable", SBATCH_SCRIPT], env, cwd=tmp_path, timeout=240, check=False)
    jid = p.stdout.strip().split(";")[0]
    jobs.append(jid)
    out = tmp_path / "runs" / f"slurm-{jid}.out"
    assert p.returncode == 0, f"sbatch --wait exited {p.returncode}: {p.stderr}\n{tail(out)}"
    info = job_info(jid, env)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{tail(out)}"
    assert info.get("NumTasks") == "4", info
    run_dir = tmp_path / "runs" / f"slurm-{jid}"
    summary = read_json(run_dir / "summary.json")
    show("reference run", jid, info, summary)
    assert summary, f"no summary.json in {run_dir}\n{tail(out)}"
    assert summary["status"] == "completed", f"{summary['status']}\n{tail(out)}"
    assert summary["final_step"] == 20
    assert summary["world_size"] == 4
    assert not summary.get("resumed_from"), "a fresh run dir must start fresh"
    assert_invariants_ok(summary, "reference run")


# ---- (b) preemption: checkpoint on SIGUSR1, then resume ---------------------------------------

STEPS, SLEEP = 30, 0.5   # slow enough that the signal lands mid-run, fast enough for ~1 minute


def signal_when_running(jid: str, run_dir: Path, env, out: Path, min_steps: int = 3):
    """Wait for a few training steps, then send what Slurm sends before the time limit."""
    wait_until(f"{min_steps} steps in {run_dir}/metrics.jsonl", lambda: step_lines(run_dir) >= min_steps, 120,
               diagnose=lambda: f"{job_info(jid, env)}\n{tail(out)}")
    run(["scancel", "--signal=USR1", "--batch", jid], env)


def check_preempted(summary: dict, run_dir: Path, where: str) -> int:
    assert summary["status"] == "preempted", f"{where}: {summary['status']}"
    k = summary["final_step"]
    assert 0 < k < STEPS, f"{where}: stopped at step {k}"
    latest = run_dir / "checkpoints" / "latest"
    assert latest.exists(), f"{where}: no checkpoints/latest after preemption"
    assert_invariants_ok(summary, where)
    return k


def check_resumed(summary: dict, k: int, run_dir: Path, where: str):
    assert summary["status"] == "completed", f"{where}: {summary['status']}"
    assert summary["final_step"] == STEPS
    assert summary.get("resumed_from"), f"{where}: did not resume: {summary.get('resumed_from')!r}"
    assert str(run_dir / "checkpoints") in str(summary["resumed_from"]), summary["resumed_from"]
    assert summary["start_step"] == k, f"{where}: resumed at {summary['start_step']}, preempted at {k}"
    assert_invariants_ok(summary, where)


def test_preempt_signal_requeues_and_resumes(slurm_conf, tmp_path, jobs):
    """USR1 -> checkpoint + status preempted -> `scontrol requeue` -> same job id resumes from latest."""
    (tmp_path / "runs").mkdir()
    env = job_env(slurm_conf)
    jid = submit(tmp_path, env, SBATCH_SCRIPT, "--steps", str(STEPS), "--sleep-per-step", str(SLEEP))
    jobs.append(jid)
    run_dir, out = tmp_path / "runs" / f"slurm-{jid}", tmp_path / "runs" / f"slurm-{jid}.out"
    signal_when_running(jid, run_dir, env, out)

    def preempted_summary():
        s = read_json(run_dir / "summary.json")
        return s if s and s.get("status") == "preempted" else None
    first = wait_until("summary.json with status preempted", preempted_summary, 60,
                       diagnose=lambda: f"{job_info(jid, env)}\n{tail(out)}")
    show("preempted run (before requeue)", jid, job_info(jid, env), first)
    k = check_preempted(first, run_dir, "preempted run")
    assert first.get("start_step", 0) == 0 and not first.get("resumed_from")

    info = wait_finished(jid, env, 180, out, restarts=1)   # local-slurm: a requeued job waits ~30 s
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{tail(out)}"
    assert int(info["Restarts"]) == 1, info
    log = out.read_text()
    assert "requeueing job" in log, tail(out)
    second = read_json(run_dir / "summary.json")
    show("requeued run", jid, info, second)
    check_resumed(second, k, run_dir, "requeued run")


def test_collective_timeout_requeues_and_resumes(slurm_conf, tmp_path, jobs, reference):
    """A rank goes silent at step 12 (CAPSTONE_FAULT=stall, first launch only): the others give up
    at --collective-timeout 3 and write collective-timeout.json; the step fails, and step.sh
    requeues the job, which resumes from step 10 and ends bit-identical to the uninterrupted run."""
    (tmp_path / "runs").mkdir()
    env = job_env(slurm_conf, CAPSTONE_FAULT="stall:1:12", CAPSTONE_FAULT_RESTART="0")
    jid = submit(tmp_path, env, SBATCH_SCRIPT, "--collective-timeout", "3")
    jobs.append(jid)
    run_dir, out = tmp_path / "runs" / f"slurm-{jid}", tmp_path / "runs" / f"slurm-{jid}.out"
    info = wait_finished(jid, env, 180, out, restarts=1)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{tail(out)}"
    assert int(info["Restarts"]) == 1, info
    assert "capstone: collective timeout" in log and "ended after a collective timeout" in log, tail(out)
    assert "requeueing job" in log, tail(out)
    record = read_json(run_dir / "collective-timeout.json")
    assert record["at"] == "step 12" and record["rank"] != 1, record
    second = read_json(run_dir / "summary.json")
    show("requeued after a collective timeout", jid, info, second)
    assert second["status"] == "completed" and second["start_step"] == 10, second["status"]
    assert_invariants_ok(second, "requeued run")
    assert second["final_param_fingerprint"] == reference[2]["final_param_fingerprint"]


def test_preempt_then_resubmit_same_run_dir_mpirun(slurm_conf, tmp_path, jobs):
    """Requeue off: the preempted job exits 0; a resubmission with the same CAPSTONE_RUN_DIR
    resumes from latest. Uses the mpirun launcher (its signal forwarding) inside the allocation."""
    (tmp_path / "runs").mkdir()
    run_dir = tmp_path / "shared-run"
    env = job_env(slurm_conf, CAPSTONE_RUN_DIR=str(run_dir), CAPSTONE_LAUNCHER="mpirun", CAPSTONE_REQUEUE="0")
    args = [SBATCH_SCRIPT, "--steps", str(STEPS), "--sleep-per-step", str(SLEEP)]
    jid = submit(tmp_path, env, *args)
    jobs.append(jid)
    out = tmp_path / "runs" / f"slurm-{jid}.out"
    signal_when_running(jid, run_dir, env, out)
    info = wait_finished(jid, env, 120, out)
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{tail(out)}"
    assert int(info.get("Restarts", 0)) == 0, info
    first = read_json(run_dir / "summary.json")
    show("preempted run (mpirun)", jid, info, first)
    assert first, tail(out)
    k = check_preempted(first, run_dir, "preempted run")

    p = run(["sbatch", "--wait", "--parsable", *args], env, cwd=tmp_path, timeout=240, check=False)
    jid2 = p.stdout.strip().split(";")[0]
    jobs.append(jid2)
    out2 = tmp_path / "runs" / f"slurm-{jid2}.out"
    assert p.returncode == 0, f"resubmission exited {p.returncode}: {p.stderr}\n{tail(out2)}"
    second = read_json(run_dir / "summary.json")
    show("resubmitted run (mpirun)", jid2, job_info(jid2, env), second)
    check_resumed(second, k, run_dir, "resubmitted run")


def fake_job_env(tmp_path, **extra: str) -> dict:
    """capstone.sbatch run by bash as Slurm would, 1 task through mpirun, without a Slurm."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CAPSTONE_"))}
    env.update(SLURM_JOB_ID="1", SLURM_NTASKS="1", CAPSTONE_LAUNCHER="mpirun", CAPSTONE_ROOT=str(ROOT),
               CAPSTONE_RUN_DIR=str(tmp_path / "run"), PATH=f"{Path(_venv()) / 'bin'}:{env['PATH']}")
    env.update(extra)
    return env


@pytest.mark.parametrize("how", ["sbatch", "launch", "launch-no-out"])
def test_an_out_other_than_the_watched_run_dir_is_refused(tmp_path, how):
    """`sbatch capstone.sbatch --out X` (or `scripts/launch RUN_DIR ... --out X`): the last --out wins, so the
    job trained in X while the script watched RUN_DIR for summary.json, and a preemption checkpoint then
    ended the job with no requeue (no summary.json there). Now exit 2 before the step, naming both."""
    env = fake_job_env(tmp_path)
    if how == "sbatch":
        cmd = ["bash", str(SBATCH_SCRIPT), "--steps", "2", "--out", "elsewhere"]
    else:
        cmd = [ROOT / "scripts" / "launch", "run", "mpirun", "-n", "1", "python", "-m", "capstone.train",
               "--steps", "2", "--out=elsewhere"]
    if how == "launch-no-out":   # capstone.train's default --out, runs/run-<time>, is not RUN_DIR either
        cmd = cmd[:-1]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    if how == "launch-no-out":
        assert p.stdout.count("error: no --out in the command") == 1 and "add --out run" in p.stdout, p.stdout
        assert not (tmp_path / "runs").exists(), p.stdout
        return
    assert p.stdout.count("error: the job's --out elsewhere is not the run directory") == 1, p.stdout
    assert "CAPSTONE_RUN_DIR=DIR" in p.stdout and not (tmp_path / "elsewhere").exists(), p.stdout


@pytest.mark.parametrize("name,value", [("CAPSTONE_REQUEUE", "yes"), ("CAPSTONE_MAX_REQUEUES", "ten"),
                                        ("CAPSTONE_ABORT_GRACE", "3s")])
def test_a_bad_requeue_switch_is_refused_before_the_step(tmp_path, name, value):
    """scripts/slurm/step.sh's switches: CAPSTONE_REQUEUE=yes used to run the job and then, after a
    preemption checkpoint, silently not requeue it (only 1 requeued), as CAPSTONE_MAX_REQUEUES=ten did
    (read as 0). Now exit 2 before the step starts, naming the variable. (No Slurm needed.)"""
    env = fake_job_env(tmp_path, **{name: value})
    p = subprocess.run(["bash", str(SBATCH_SCRIPT), "--steps", "2"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout.count(f"error: {name}='{value}'") == 1, p.stdout
    assert "job step exited" not in p.stdout and not (tmp_path / "run" / "summary.json").exists(), p.stdout


def test_a_first_start_into_an_earlier_jobs_run_dir_is_refused(tmp_path):
    """runs/slurm-<job id> of a job's first start holding a run: an earlier job with the same id (another
    cluster on the filesystem, job ids started again) wrote it. The new job used to --resume auto it: here
    it found it finished and did nothing, COMPLETED (seen on the local multi-node Slurm, whose ids start at
    1); with more --steps it would have trained on another run. Exit 2, nothing touched; a requeue
    (SLURM_RESTART_COUNT 1) of the same job still resumes it. (No Slurm needed.)"""
    old = tmp_path / "runs" / "slurm-1"
    old.mkdir(parents=True)
    (old / "summary.json").write_text('{"status": "completed"}')
    env = fake_job_env(tmp_path)
    del env["CAPSTONE_RUN_DIR"]
    p = subprocess.run(["bash", str(SBATCH_SCRIPT), "--steps", "2"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout.count(f"error: {old.relative_to(tmp_path)} already holds a run") == 1, p.stdout
    assert f"CAPSTONE_RUN_DIR={old.relative_to(tmp_path)} sbatch" in p.stdout, p.stdout
    assert os.listdir(old) == ["summary.json"] and "running:" not in p.stdout, p.stdout
    p = subprocess.run(["bash", str(SBATCH_SCRIPT), "--steps", "2"], capture_output=True, text=True,
                       env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=tmp_path, timeout=120)
    assert "already holds a run" not in p.stdout and "running:" in p.stdout, p.stdout + p.stderr


def test_the_last_allowed_requeue_says_why_the_job_is_not_requeued(tmp_path):
    """A preemption checkpoint once the job has been requeued CAPSTONE_MAX_REQUEUES times: the job ends
    (exit 0) with the resume hint, and now says why it was not requeued (it used to say only 'to resume',
    as with CAPSTONE_REQUEUE=0). --stop-after stands in for the signal. (No Slurm needed.)"""
    env = fake_job_env(tmp_path, SLURM_RESTART_COUNT="2", CAPSTONE_MAX_REQUEUES="2")
    p = subprocess.run(["bash", str(SBATCH_SCRIPT), "--steps", "4", "--stop-after", "2"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0 and "summary status: preempted" in p.stdout, p.stdout + p.stderr
    assert "not requeueing: job 1 has been requeued 2 times, CAPSTONE_MAX_REQUEUES=2" in p.stdout, p.stdout
    assert "to resume: CAPSTONE_RUN_DIR=" in p.stdout, p.stdout


def test_a_run_dir_that_cannot_be_made_is_a_clear_error(tmp_path):
    """CAPSTONE_RUN_DIR naming a file (or a path that cannot be made): the job used to end with mkdir's
    own message and exit 1; now exit 2 with the directory and what to set. (No Slurm needed.)"""
    (tmp_path / "notes").write_text("kept")
    env = fake_job_env(tmp_path, CAPSTONE_RUN_DIR="notes")
    p = subprocess.run(["bash", str(SBATCH_SCRIPT), "--steps", "2"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout.count("error: cannot create the run directory notes (") == 1, p.stdout + p.stderr
    assert "set CAPSTONE_RUN_DIR to a directory" in p.stdout and (tmp_path / "notes").read_text() == "kept"


def test_stopping_another_cluster_leaves_munged_to_the_one_running(slurm_conf, tmp_path):
    """Issue 53, item 7: `local-slurm --stop` of one cluster stopped the munged that it had started when only
    the other default cluster's pid file said otherwise, so a cluster with its own CAPSTONE_SLURM_DIR (or the
    single-node one, seen from --nodes) lost its munge authentication mid-job. Now any Slurm daemon still
    running on the machine keeps munged: a cluster with another state dir, stopped while this one runs, leaves
    munge working and this cluster taking jobs."""
    other = tmp_path / "other-cluster"
    (other / "run").mkdir(parents=True)
    (other / "run" / "munged.started-by-local-slurm").write_text("")   # as if it had started munged
    res = subprocess.run(["bash", str(LOCAL_SLURM), "--stop"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CAPSTONE_SLURM_DIR": str(other)})
    assert res.returncode == 0, res.stdout + res.stderr
    munge = subprocess.run("munge -n -S /run/munge/munge.socket.2 | unmunge -S /run/munge/munge.socket.2",
                           shell=True, capture_output=True, text=True, timeout=30)
    assert munge.returncode == 0, munge.stdout + munge.stderr
    ping = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLURM_CONF": slurm_conf})
    assert ping.returncode == 0 and ping.stdout.strip(), ping.stdout + ping.stderr
