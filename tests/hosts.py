"""Test helper: Open MPI across a few "hosts" (network namespaces on this machine; scripts/hosts).

    with Hosts(2).session() as hosts:        # lock, `scripts/hosts up 2`, always `down` at the end
        hosts.mpirun("h1:2,h2:2", [sys.executable, "-m", "capstone.train", "--out", out])
        job = hosts.start("h1:2,h2:2", [...], log_path)   # in the background
        hosts.kill("h2"); hosts.cut("h2"); hosts.heal("h2"); hosts.pids("h1")

Every call has a deadline; a background job still running when the session ends is killed with
every process on every host (`scripts/hosts down` kills what is left inside the namespaces).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "hosts"
PREFIX = os.environ.get("CAPSTONE_HOSTS_PREFIX", "cap")
SESSION_LOCK = Path(f"/run/lock/{PREFIX}-hosts.session.lock")


class HostsUnavailable(Exception):
    """Network-namespace hosts cannot be made here; the message says why."""


def unavailable_reason() -> str | None:
    """Why the hosts cannot work on this machine (None: they should)."""
    if not sys.platform.startswith("linux"):
        return "network-namespace hosts need Linux"
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add, veth, bridge)"
    if not shutil.which("mpirun"):
        return "mpirun is not on PATH (scripts/setup installs Open MPI)"
    for tool, package in (("unshare", "util-linux"), ("flock", "util-linux")):
        if not shutil.which(tool):
            return f"{tool} is missing (apt-get install {package})"
    if not shutil.which("ip") and not shutil.which("apt-get"):
        return "iproute2's `ip` is missing and there is no apt-get to install it"
    return None


def env() -> dict:
    """The environment of the harness and of the ranks: this checkout on PYTHONPATH."""
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
             OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
             PYTHONPATH=str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else ""))
    return e


class Hosts:
    def __init__(self, n: int = 2):
        self.n = n
        self.names = [f"h{i}" for i in range(1, n + 1)]
        self.jobs: list[subprocess.Popen] = []

    # ---- lifetime ---------------------------------------------------------------------------
    def script(self, *args, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """`scripts/hosts ARGS` (not for mpirun: see mpirun / start)."""
        p = subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                           timeout=timeout, env=env(), cwd=ROOT)
        if check and p.returncode != 0:
            raise RuntimeError(f"scripts/hosts {' '.join(map(str, args))} exited {p.returncode}:\n{p.stdout}{p.stderr}")
        return p

    @contextlib.contextmanager
    def session(self, lock_timeout: float = 600):
        """Hold the session lock (one test session per prefix at a time), bring the hosts up,
        yield, and ALWAYS tear down: on failure, Ctrl-C and SIGTERM too."""
        SESSION_LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(SESSION_LOCK, "w") as lock:
            deadline = time.monotonic() + lock_timeout
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise HostsUnavailable(f"another test session holds {SESSION_LOCK} for over "
                                               f"{lock_timeout:.0f} s (set CAPSTONE_HOSTS_PREFIX to run beside it)")
                    time.sleep(1)
            previous = signal.getsignal(signal.SIGTERM)

            def on_term(signum, frame):  # pytest runs finalizers on KeyboardInterrupt, not on SIGTERM
                raise KeyboardInterrupt(f"signal {signum}")
            signal.signal(signal.SIGTERM, on_term)
            try:
                up = self.script("up", self.n, check=False, timeout=300)
                if up.returncode != 0:
                    raise HostsUnavailable(f"`scripts/hosts up {self.n}` failed (exit {up.returncode}): "
                                           f"{(up.stderr or up.stdout).strip()[-2000:]}")
                yield self
            finally:
                try:
                    self.stop_jobs()
                finally:
                    self.script("down", check=False, timeout=300)
                    signal.signal(signal.SIGTERM, previous)

    def reset(self) -> None:
        """Every link up and no process on any host: the state each test starts from."""
        self.stop_jobs()
        for h in self.names:
            self.script("kill", h)   # a dead host (no process, empty memory, off the network) ...
            self.script("heal", h)   # ... back up

    # ---- launching ----------------------------------------------------------------------------
    def mpirun_command(self, hosts: str, cmd: list, extra=()) -> list[str]:
        return ["bash", str(SCRIPT), "mpirun", "--hosts", hosts, *extra, "--", *map(str, cmd)]

    def mpirun(self, hosts: str, cmd: list, timeout: float = 180, extra=()) -> subprocess.CompletedProcess:
        """Run CMD on the ranks of HOSTS (like h1:2,h2:2) and wait; kills everything on timeout."""
        job = subprocess.Popen(self.mpirun_command(hosts, cmd, extra), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT, start_new_session=True)
        self.jobs.append(job)
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop_jobs()
            out, err = job.communicate()
            raise AssertionError(f"mpirun on {hosts} did not end within {timeout} s:\n{out}\n{err}")
        return subprocess.CompletedProcess(job.args, job.returncode, out, err)

    def start(self, hosts: str, cmd: list, log: Path, extra=()) -> subprocess.Popen:
        """Start CMD on the ranks of HOSTS in the background; stdout+stderr go to LOG."""
        with open(log, "w") as f:
            job = subprocess.Popen(self.mpirun_command(hosts, cmd, extra), stdout=f, stderr=subprocess.STDOUT,
                                   env=env(), cwd=ROOT, start_new_session=True)
        self.jobs.append(job)
        return job

    def stop_jobs(self) -> None:
        """End every job this object started (SIGTERM to mpirun's group, then SIGKILL), and every
        process left on any host."""
        live = [j for j in self.jobs if j.poll() is None]
        for j in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(j.pid, signal.SIGTERM)
        for j in live:
            try:
                j.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(j.pid, signal.SIGKILL)
                j.wait(timeout=10)
        self.jobs = [j for j in self.jobs if j.poll() is None]
        if live:
            for h in self.names:
                self.script("kill", h, check=False)

    # ---- faults and observation -----------------------------------------------------------------
    def kill(self, host: str) -> None:
        self.script("kill", host)

    def cut(self, host: str) -> None:
        self.script("cut", host)

    def heal(self, host: str) -> None:
        self.script("heal", host)

    def pids(self, host: str) -> list[int]:
        p = subprocess.run(["ip", "netns", "pids", f"{PREFIX}-{host}"], capture_output=True, text=True, timeout=30)
        return [int(x) for x in p.stdout.split()]

    def link_bytes(self, host: str) -> tuple[int, int]:
        """(received, sent) bytes of HOST's eth0: the traffic that crossed the 'wire'."""
        p = subprocess.run(["ip", "-n", f"{PREFIX}-{host}", "-s", "-j", "link", "show", "eth0"],
                           capture_output=True, text=True, timeout=30, check=True)
        stats = json.loads(p.stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def wait_no_processes(self, hosts, timeout: float) -> dict:
        """Wait until no process runs on HOSTS; returns {host: pids} still running at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            left = {h: self.pids(h) for h in hosts}
            left = {h: p for h, p in left.items() if p}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)
