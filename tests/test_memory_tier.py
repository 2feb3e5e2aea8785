"""Issue 50's memory tier on one host (the lost hosts are tests/test_multihost.py's and test_slurm_nodes.py's):
its files and their checks, a full tmpfs, and another run's tier.

    python -m pytest tests/test_memory_tier.py
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from capstone.checkpoint import recover, tier
from conftest import ROOT, mpi_env, mpirun, summary

def ranks_of(out) -> list[int]:
    """The pids of the processes whose command line holds `--out OUT` (no pgrep: a bare Debian has no procps)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            words = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"capstone.train" in words and str(out).encode() in words and b"mpirun" not in words[0]:
            found.append(int(pid))
    return found


FLAGS = ("--steps", 12, "--memory-tier", "--deterministic", "--global-batch", 8, "--batch-size", 2, "--grad-accum", 0)


def test_each_rank_keeps_its_copy_on_another_host():
    assert tier.buddies(["h1", "h1", "h2", "h2"]) == [2, 3, 0, 1]       # the same local rank on the next node
    assert tier.buddies(["a", "b", "a", "b"]) == [1, 0, 3, 2]
    assert tier.buddies(["h1", "h1", "h1", "h2"]) == [3, 3, 3, 0]       # uneven: h2's rank keeps three copies
    assert tier.buddies(["h1", "h1"]) == [None, None]                   # one host: no copy elsewhere


def tier_file(tmp_path, monkeypatch, run_id="r1", header_run_id=None, step=3):
    monkeypatch.setenv("CAPSTONE_MEMORY_DIR", str(tmp_path))
    os.makedirs(tier.step_dir(run_id, step))
    path = os.path.join(tier.step_dir(run_id, step), "own-rank-0")
    m, buf = tier.mapped(path, tier.file_bytes(5))
    rows = np.arange(15, dtype=np.float32).reshape(3, 5)
    np.ndarray((3, 5), "<f4", m)[...] = rows
    tier.seal(buf, {"run_id": header_run_id or run_id, "step": step, "rank": 0, "world": 1, "shard": 5, "adam_t": step,
                    "launch": "x", "meta": {}})
    return path, rows


def test_a_tier_file_reads_back_and_a_flipped_byte_or_a_cut_copy_is_refused(tmp_path, monkeypatch):
    path, rows = tier_file(tmp_path, monkeypatch)
    header = tier.header_of(path)
    assert header["step"] == 3 and np.array_equal(tier.rows_of(path, header), rows)
    assert [e["rank"] for e in recover.listing("r1")] == [0]
    data = bytearray(open(path, "rb").read())
    for at in (7, len(data) - tier.TRAILER + tier.HEAD.size + 2):   # a byte of the rows; of the header
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        open(path, "wb").write(flipped)
        h = tier.header_of(path)
        assert h is None or tier.rows_of(path, h) is None
    open(path, "wb").write(bytes(data[:-tier.TRAILER]) + bytes(tier.TRAILER))   # a copy cut off: no trailer yet
    assert tier.header_of(path) is None and recover.listing("r1") == []


def test_another_runs_files_are_never_listed(tmp_path, monkeypatch):
    """A file in this run's directory whose header names another run (copied there, or a reused id) is not taken."""
    tier_file(tmp_path, monkeypatch, run_id="mine", header_run_id="theirs")
    assert recover.listing("mine") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_tmpfs_is_reported_and_the_run_goes_on_with_disk_checkpoints(tmp_path):
    """A real tmpfs of 256 KiB, too small for a step's file: one warning, exit 0, the disk checkpoints as always."""
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(shm)], check=True)
    try:
        p = mpirun(2, "--out", tmp_path / "run", *FLAGS, env_extra={"CAPSTONE_MEMORY_DIR": str(shm)})
        left = os.listdir(shm)
    finally:
        subprocess.run(["umount", str(shm)], check=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    warned = [line for line in p.stdout.splitlines() if "does not fit in node memory" in line]
    assert len(warned) == 1 and "step 1" in warned[0] and "No space left on device" in warned[0], p.stdout
    assert "the run goes on with its disk checkpoints only" in warned[0]
    assert summary(tmp_path / "run")["status"] == "completed" and (tmp_path / "run/checkpoints/latest").exists()
    assert left == [], left   # nothing half there


def test_a_new_run_in_a_reused_directory_never_takes_the_old_runs_tier(tmp_path):
    """Run A is killed and leaves its tier; its directory is moved away and run B starts in its name with
    --resume auto: B starts fresh, and A's tier is left as it was."""
    out = tmp_path / "run"
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", out, *FLAGS,
           "--steps", 200, "--sleep-per-step", 0.2]
    job = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=mpi_env(),
                           cwd=ROOT, start_new_session=True)
    try:
        while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text().count('"step"') < 4:
            assert job.poll() is None, "run A ended early"
            time.sleep(0.05)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        while ranks_of(out):   # the ranks too
            time.sleep(0.05)
    from capstone.checkpoint import rundir
    theirs = rundir.logged_run_id(str(out / "metrics.jsonl"))
    before = sorted(os.listdir(tier.run_dir(theirs)))
    os.rename(out, tmp_path / "moved")
    p = mpirun(2, "--out", out, *FLAGS, "--resume", "auto")
    assert p.returncode == 0, p.stdout[-3000:]
    assert summary(out)["start_step"] == 0 and "node memory" not in p.stdout, p.stdout
    assert sorted(os.listdir(tier.run_dir(theirs))) == before
    subprocess.run(["rm", "-rf", tier.run_dir(theirs)])


def test_a_killed_rank_resumes_from_memory_on_fewer_ranks_with_the_same_bits(tmp_path):
    """A rank of a 2-rank run is killed (SIGKILL: mpirun ends the other); --resume auto on 1 rank takes the newest
    step from the node's memory (both ranks' own files: the node lived on), not the disk's older checkpoint, with
    the accumulation doubled, and ends bit-identical to the run that never failed."""
    out, ref = tmp_path / "run", tmp_path / "ref"
    flags = (*FLAGS, "--steps", 16, "--ckpt-every", 5)
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", out, *flags,
           "--sleep-per-step", 0.2]
    job = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=mpi_env(),
                           cwd=ROOT, start_new_session=True)
    while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text().count('"step"') < 8:
        assert job.poll() is None, "the run ended early"
        time.sleep(0.05)
    os.kill(ranks_of(out)[-1], signal.SIGKILL)
    job.wait(timeout=60)
    p = mpirun(1, "--out", out, *flags, "--resume", "auto")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    start = summary(out)["start_step"]
    assert f"resuming from node memory: step {start} of 2 ranks (ranks 0-1: own on " in p.stdout, p.stdout
    assert start >= 7 and "grad_accum: 2 -> 4" in p.stdout, p.stdout
    assert mpirun(1, "--out", ref, *flags).returncode == 0
    from capstone import checkpoint
    logical = [checkpoint.read_meta_file(str(d / "checkpoints/ckpt-00000016.h5"))["logical_sha256"] for d in (out, ref)]
    assert logical[0] == logical[1]   # master, m and v
