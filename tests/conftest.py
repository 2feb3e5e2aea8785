"""Shared helpers for the serial tests (the ones under tests/mpi run under mpirun)."""

import fcntl
import json
import os
import pathlib
import signal
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


# scripts/test's phases (the markers are registered in pyproject.toml):
# - serial: tests whose assertions fail on a loaded machine (wall-clock checkpoint spacing: steps of
#   0.25 s against a 0.6 s interval; a Ctrl-C's stop within Open MPI's default kill sequence, which
#   failed once in 13 beside the whole suite in the bare root); they run in scripts/test's last
#   phase, `-m serial`, alone.
# - TIMING: tests that time their runs or race them (collective deadlines, stop signals and kills
#   mid-run, lock and disk-full timings, wall-clock checkpoints) but hold with CPU load beside
#   them: they run one at a time, on one pytest-xdist worker (xdist_group "timing"); the
#   network-namespace hosts (tests/test_multihost.py) likewise on another ("hosts").
# - the modules whose module-scoped fixtures make runs stay on one worker (their runs made once).
# - quick (scripts/test --quick): the unit tests and the composition matrix's rows that never use
#   more than QUICK_ROW_RANKS ranks.
# The phases' order (heaviest first, so that no long group starts last) is ORDER's, then collection order.
SERIAL = {"test_checkpoint_retention.py": None,   # Ctrl-C under Open MPI's 2 s kill sequence, 13 times: quiet
          "test_ctrl_c.py": {"test_ctrl_c_on_the_readme_route_saves_a_checkpoint_that_resumes"}}
TIMING = {
    "test_deadlines.py": None, "test_stop.py": None, "test_disk_full.py": None, "test_ctrl_c.py": None,
    "test_async_checkpoints.py": None,
    "test_endings.py": {"test_a_collective_timeout_writes_summary_json"},
    "test_startup.py": {"test_second_run_on_the_same_out_is_refused_and_a_killed_run_leaves_no_stale_lock"},
    "test_resume.py": {"test_sigusr1_checkpoints_at_step_boundary_and_resume_finishes", "test_wall_clock_checkpoints"},
    "test_pipeline.py": {"test_kill_9_mid_run_then_resume_auto_is_bit_identical"},
    "test_cp.py": {"test_kill_9_of_a_cp_rank_mid_run_then_resume_auto_is_bit_identical"},
}
HOSTS = {"test_multihost.py"}
MODULE_GROUPS = {"test_cli_fixes.py", "test_clip_and_schedule.py", "test_deterministic.py", "test_export.py",
                 "test_finetune.py", "test_integrity.py", "test_kept_modes.py", "test_learning.py", "test_pipeline.py",
                 "test_precision.py",
                 "test_reference_bits.py", "test_sample.py", "test_sample_legacy.py", "test_text_training.py",
                 "test_tp.py", "test_zero_stages.py"}
ORDER = ["timing", "hosts", "test_trials.py", "test_finetune.py", "test_zero_stages.py", "test_learning.py",
         "test_integrity.py", "test_deterministic.py", "test_tp.py", "test_pipeline.py", "test_sample.py"]
QUICK = {"test_accounting.py", "test_architecture.py", "test_backward.py", "test_cli.py", "test_digest.py", "test_usage.py",
         "test_heap.py", "test_invariants.py", "test_model.py", "test_no_pickle.py", "test_packaging.py",
         "test_prepare.py", "test_textdata.py", "test_tokenizer.py", "test_placement.py"}
QUICK_ROW_RANKS = 2


def _listed(table, module: str, name: str) -> bool:
    return module in table and (table[module] is None or name in table[module])


def row_ranks(row) -> int:
    """The most ranks any launch of a composition row uses (the row, its resume, its deterministic partner)."""
    import composition
    partner = composition.det_partner(row) if row.det else None
    return max(row.world, row.resumed().world if row.resume else 0, partner.world if partner else 0)


def group_of(module: str, name: str):
    """The pytest-xdist work unit of a test (None: a unit of its own), and whether it is `serial`."""
    if _listed(SERIAL, module, name):
        return None, True
    if _listed(TIMING, module, name):
        return "timing", False
    if module in HOSTS:
        return "hosts", False
    return (module if module in MODULE_GROUPS else None), False


def pytest_itemcollected(item):
    group, serial = group_of(item.path.name, getattr(item, "originalname", item.name))
    if serial:
        item.add_marker(pytest.mark.serial)
    row = getattr(getattr(item, "callspec", None), "params", {}).get("row")
    if item.path.name in QUICK or (item.path.name == "test_composition.py" and row is not None
                                   and row_ranks(row) <= QUICK_ROW_RANKS):
        item.add_marker(pytest.mark.quick)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The heaviest groups first (ORDER), then collection order: pytest-xdist hands them out in this order."""
    def rank(item):
        key = group_of(item.path.name, getattr(item, "originalname", item.name))[0] or item.path.name
        return ORDER.index(key) if key in ORDER else len(ORDER)
    items.sort(key=rank)   # stable


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with the groups above (group_of), given to pytest-xdist's scope scheduler as
    the tests' scopes: each group runs on one worker, in the order of the collection. (pytest-xdist's
    own loadgroup names the group in the node id, which pytest 9 no longer lets a plugin change.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, rest = nodeid.partition("::")
            return group_of(os.path.basename(path), rest.split("[")[0].split("::")[-1])[0] or nodeid
    return GroupScheduling(config, log)


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


def kill_a_rank_after_checkpoint(tmp_path, n: int, out, flags, victim: int, step: int = 4) -> subprocess.Popen:
    """Launch `n` ranks on `flags` (0.4 s a step), SIGKILL rank `victim` 0.6 s after checkpoint `step`
    appears (between checkpoints), and wait for the job to end; returns it."""
    pids = tmp_path / "pids"
    pids.mkdir()
    job = launch(n, "--out", out, *flags, "--sleep-per-step", 0.4, env_extra={"CAPSTONE_FAULT_PIDS": str(pids)})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "checkpoints" / f"ckpt-{step:08d}.h5").exists():
            time.sleep(0.05)
        time.sleep(0.6)
        os.kill(int((pids / str(victim)).read_text()), signal.SIGKILL)
        job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return job


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


def shared_dir(tmp_path_factory) -> pathlib.Path:
    """Where runs that several tests read are made once: $CAPSTONE_TEST_SHARED (scripts/test makes a
    fresh one for all its phases), else the directory the pytest-xdist workers of this session
    share, else this session's own."""
    if os.environ.get("CAPSTONE_TEST_SHARED"):
        return pathlib.Path(os.environ["CAPSTONE_TEST_SHARED"])
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.getbasetemp().parent
    return tmp_path_factory.getbasetemp()


def made_once(tmp_path_factory, name: str, make) -> dict:
    """make(dir) -> a JSON-able result, run by the first process to ask (the others wait on a file
    lock and read the result it left): one run however many workers and phases read it."""
    base = shared_dir(tmp_path_factory) / name
    base.mkdir(parents=True, exist_ok=True)
    done = base / "result.json"
    with open(base / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            tmp = base / "result.json.tmp"
            tmp.write_text(json.dumps(make(base)))
            os.replace(tmp, done)
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The reference experiment on 4 ranks, run once per session (once for all pytest-xdist workers
    and scripts/test phases): (run dir, result, summary)."""
    def make(base):
        res = mpirun(4, "--out", base / "run")
        return {"args": res.args, "returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr}
    made = made_once(tmp_path_factory, "reference", make)
    out = shared_dir(tmp_path_factory) / "reference" / "run"
    res = subprocess.CompletedProcess(made["args"], made["returncode"], made["stdout"], made["stderr"])
    assert res.returncode == 0, res.stdout + res.stderr
    return out, res, summary(out)


@pytest.fixture
def run_train():
    return mpirun


def code_at(tmp_path_factory, commit: str):
    """The capstone package of `commit`, unpacked from git into a directory of its own (the test is
    skipped, with the reason, when the checkout does not have that commit)."""
    from benchmarks.compare import unpack
    where = tmp_path_factory.mktemp("before")
    try:
        unpack(commit, str(where))
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"commit {commit} is not in this checkout's history ({exc}): clone the repository to run this")
    return where
