"""The local multi-node Slurm of tests/test_slurm_nodes.py (scripts/slurm/local-slurm --nodes N) and
the helpers its tests share: submit and wait, check a completed job, read a checkpoint's digests,
time a log line, look into the network-namespace hosts."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import time
from pathlib import Path

from test_slurm import _unavailable, assert_invariants_ok, job_env, read_json, run, show, tail, wait_finished

ROOT = Path(__file__).resolve().parents[1]
LOCAL_SLURM = ROOT / "scripts" / "slurm" / "local-slurm"
SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "capstone.sbatch"
TEMPLATE = ROOT / "scripts" / "slurm" / "template.sbatch"
HOSTS = ROOT / "scripts" / "hosts"
PREFIX = os.environ.get("CAPSTONE_SLURM_HOSTS_PREFIX", "slm")


class Cluster:
    """The local multi-node cluster: (re)started with `ensure(n)` nodes; `env()` submits to it."""

    def __init__(self):
        self.n, self.conf, self.bin = 0, "", ""

    def ensure(self, n: int, repair: bool = False) -> "Cluster":
        """n nodes up (repair: a node lost by a test back: link up, slurmd again, node resumed)."""
        if self.n == n and not repair:
            return self
        t0 = time.monotonic()
        try:
            p = subprocess.run(["bash", str(LOCAL_SLURM), "--nodes", str(n)], capture_output=True, text=True,
                               timeout=600)
        except subprocess.TimeoutExpired:
            _unavailable(f"scripts/slurm/local-slurm --nodes {n} did not finish within 600 s")
        m = re.search(r"^export SLURM_CONF=(\S+) PATH=(\S+):\$PATH$", p.stdout, re.M)
        if p.returncode != 0 or not m:
            _unavailable(f"scripts/slurm/local-slurm --nodes {n} could not start Slurm (exit {p.returncode}):\n"
                         f"{p.stdout}{p.stderr[-3000:]}")
        self.n, self.conf, self.bin = n, m.group(1), m.group(2)
        print(f"local-slurm --nodes {n}: up in {time.monotonic() - t0:.1f} s", flush=True)
        return self

    def env(self, **extra: str) -> dict:
        e = job_env(self.conf, **extra)
        e["PATH"] = f"{self.bin}:{e['PATH']}"
        return e

    def stop(self) -> subprocess.CompletedProcess:
        self.n = 0
        return subprocess.run(["bash", str(LOCAL_SLURM), "--nodes", "2", "--stop"], capture_output=True, text=True,
                              timeout=300)


def sbatch(cluster, cwd: Path, jobs: list, *args, env=None, timeout: float = 300):
    """Submit capstone.sbatch (ARGS: sbatch options, then the script and its flags) and wait for the
    job to end (polling each second: `sbatch --wait` polls ever more slowly); returns (job id, job
    info, run dir, log path, seconds)."""
    env = env or cluster.env()
    (cwd / "runs").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    jid = run(["sbatch", "--parsable", *args], env, cwd=cwd).stdout.strip().split(";")[0]
    jobs.append(jid)
    out = cwd / "runs" / f"slurm-{jid}.out"
    info = wait_finished(jid, env, timeout, out)
    return jid, info, cwd / "runs" / f"slurm-{jid}", out, time.monotonic() - t0


def completed(jid, info, run_dir, out, seconds, where) -> dict:
    summary = read_json(run_dir / "summary.json")
    show(f"{where} ({seconds:.0f} s)", jid, info, summary)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{tail(out)}"
    assert summary and summary["status"] == "completed", tail(out)
    assert_invariants_ok(summary, where)
    return summary


def final_digests(run_dir: Path):
    """(step, logical sha256 digests) of the run's newest checkpoint."""
    from capstone import checkpoint
    path = sorted(glob.glob(str(run_dir / "checkpoints" / "ckpt-*.h5")))[-1]
    meta = checkpoint.read_meta_file(path)
    return meta["step"], meta["logical_sha256"]


def netns_of(pid: int) -> str:
    p = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True, timeout=30)
    return p.stdout.strip()


def seconds_after(log: str, since: float, pattern: str) -> float:
    """Seconds from `since` (epoch) to the first line of LOG matching PATTERN (HH, MM, SS groups, today)."""
    hms = re.search(pattern, log)
    assert hms, f"no line matches {pattern!r}:\n{log[-3000:]}"
    day = time.localtime(since)
    at = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, *map(int, hms.groups()), 0, 0, -1))
    return at - since


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed process its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def namespace_pids(host: str) -> list[int]:
    p = subprocess.run(["ip", "netns", "pids", f"{PREFIX}-{host}"], capture_output=True, text=True, timeout=30)
    return [int(x) for x in p.stdout.split()]
