"""Shared helpers for the serial tests (the ones under tests/mpi run under mpirun)."""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A job that ends abnormally (any rank exiting non-zero) makes mpirun send the ranks SIGCONT, then
# SIGTERM and SIGKILL after odls_base_sigkill_timeout seconds each, sleeping through them. scripts/env.sh
# sets 3 s, room for the stop request a SIGCONT is to save a checkpoint; the tests' jobs use Open MPI's
# default, 1 s, so that each of the suite's many expected failures costs about 1.5 s instead of 5.5 s.
# The tests of Ctrl-C and kill launch through scripts/env.sh (tests/test_robust.py `launch`): 3 s.
TEST_SIGKILL_TIMEOUT = "1"


def mpi_env() -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               OMPI_MCA_odls_base_sigkill_timeout=TEST_SIGKILL_TIMEOUT)
    return env


def mpirun(n: int, *args, timeout: float = 180, env_extra=None) -> subprocess.CompletedProcess:
    """Run `python -m capstone.train ARGS` (or `-m MODULE` if args[0] starts with '-m') on n ranks."""
    env = mpi_env()
    env.update(env_extra or {})
    module = ["-m", "capstone.train"] if not args or args[0] != "-m" else []
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", sys.executable, *module, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def summary(out) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def flip_shard_byte(path, rank: int, index: int, mask: int) -> None:
    """XOR byte `index` of rank `rank`'s shard data in checkpoint `path` with `mask`: a real corruption
    on disk, below HDF5 (the file's own metadata stays valid)."""
    import h5py
    with h5py.File(path, "r") as f:
        offset = f[f"shards/rank{rank:05d}"].id.get_offset() + index
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ mask]))


def by_step(out) -> dict:
    """metrics.jsonl of a run as {step: (loss, eval_loss, fingerprint)}, the latest row of a step
    winning (a resumed run repeats the steps after its checkpoint)."""
    rows = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if "step" in r:
                rows[r["step"]] = (r["loss"], r["eval_loss"], r["fingerprint"])
    return rows


def step_rows(out, key=None) -> list:
    """The step rows of metrics.jsonl in step order (the latest row of a repeated step), or their `key`."""
    rows = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            if "step" in r:
                rows[r["step"]] = r
    ordered = [rows[k] for k in sorted(rows)]
    return ordered if key is None else [r[key] for r in ordered]


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


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The reference experiment on 4 ranks, run once per session: (run dir, result, summary)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    res = mpirun(4, "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    return out, res, summary(out)


@pytest.fixture
def run_train():
    return mpirun
