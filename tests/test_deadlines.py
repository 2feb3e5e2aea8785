"""No collective hangs forever: a silent rank ends the job at --collective-timeout (capstone.collective.deadline).

Run serially (the tests start their own 4-rank jobs): python -m pytest -q tests/test_deadlines.py
The fault `CAPSTONE_FAULT=stall:<rank>:<step>[:<save point>]` makes one rank sleep 60 s, silent,
like a hung or unreachable node. The other ranks must print the one-line message and abort: the
job exits non-zero within the timeout plus a few seconds, and the newest checkpoint on disk is the
last complete one. (The same across hosts with a cut link: tests/test_multihost.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mpi_env

TIMEOUT_S = 3          # --collective-timeout of these runs
SLACK_S = 6            # from the stall to the job's end: timeout + this (measured ~1 s of Abort)


def stalled_run(out, fault: str, *flags) -> tuple[int, str, float]:
    """Start 4 ranks with CAPSTONE_FAULT=fault; returns (exit code, output, seconds from the stall to the end)."""
    log = f"{out}.log"
    env = {**mpi_env(), "CAPSTONE_FAULT": fault}
    cmd = ["mpirun", "-n", "4", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", str(out),
           "--collective-timeout", str(TIMEOUT_S), "--ckpt-every", "2", "--quiet", *map(str, flags)]
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        stalled = None
        deadline = time.monotonic() + 120
        while job.poll() is None and time.monotonic() < deadline:
            if stalled is None and "CAPSTONE_FAULT: stalling" in open(log).read():
                stalled = time.monotonic()
            time.sleep(0.05)
        if job.poll() is None:
            raise AssertionError(f"the job did not end within 120 s:\n{open(log).read()[-3000:]}")
        text = open(log).read()
        assert stalled is not None, f"the stall never happened:\n{text[-3000:]}"
        return job.returncode, text, time.monotonic() - stalled
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()


def assert_timed_out(rc: int, text: str, ended: float, step: int, what: str = "reduce-scatter") -> None:
    print(f"stall -> job ended after {ended:.1f} s (exit {rc}); the message:\n"
          + "\n".join(ln for ln in text.splitlines() if "collective timeout" in ln))
    assert rc != 0
    lines = [ln for ln in text.splitlines() if "capstone: collective timeout" in ln]
    assert lines, f"no timeout message:\n{text[-3000:]}"
    assert all(f"at step {step}" in ln and f"--collective-timeout {TIMEOUT_S}" in ln and "--resume auto" in ln
               and "dead or unreachable" in ln for ln in lines), lines
    assert any(what in ln for ln in lines), lines
    assert "rank 1/" not in "".join(lines), "the stalled rank itself never reaches a collective"
    assert ended <= TIMEOUT_S + SLACK_S, f"the job took {ended:.1f} s after the stall (timeout {TIMEOUT_S} s)"


def inspect_ok(path) -> None:
    p = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "inspect", str(path)], capture_output=True,
                       text=True, timeout=60, env=mpi_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_stalled_rank_times_out_in_the_reduce(tmp_path):
    out = tmp_path / "stall"
    rc, text, ended = stalled_run(out, "stall:1:3")
    assert_timed_out(rc, text, ended, 3, "reduce-scatter of the gradient")
    record = json.loads((out / "collective-timeout.json").read_text())   # for the batch scripts' watchdog
    assert record["at"] == "step 3" and record["rank"] != 1 and record["collective"] == "reduce-scatter of the gradient"
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "ckpt-00000002.h5"
    inspect_ok(ckpts / "ckpt-00000002.h5")


def test_stall_during_a_save_never_publishes_it(tmp_path):
    """Rank 1 goes silent after writing its shard of checkpoint 4 (before the ranks agree that every
    write succeeded): the others time out in that agreement; checkpoint 4 is never published."""
    out = tmp_path / "stall-save"
    rc, text, ended = stalled_run(out, "stall:1:4:after_data")
    assert_timed_out(rc, text, ended, 4, "allgather")
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "ckpt-00000002.h5"
    assert not (ckpts / "ckpt-00000004.h5").exists()
    inspect_ok(ckpts / "ckpt-00000002.h5")
    p = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out",
                        str(out), "--resume", "auto", "--steps", "6"],   # not --quiet: it hides the resumed-from line
                       capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resumed from" in p.stdout and "ckpt-00000002.h5" in p.stdout


# ---- a real stopped process (SIGSTOP) inside a collective ------------------------------------------
def stopped_job(out, ranks: int, fault: str, *flags, timeout: float = TIMEOUT_S, env: dict | None = None):
    """Run `ranks` ranks with CAPSTONE_FAULT=fault (a `stop` action: that rank sends itself SIGSTOP at
    a hook point); returns (exit code, output, seconds from the stop to the end of the job). Every
    rank's pid is recorded, and any rank still alive at the end is killed, stopped or not."""
    pids = out.parent / f"{out.name}-pids"
    pids.mkdir()
    env = {**mpi_env(), "CAPSTONE_FAULT": fault, "CAPSTONE_FAULT_PIDS": str(pids), **(env or {})}
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", str(out),
           "--collective-timeout", str(timeout), "--ckpt-every", "2", "--quiet", *map(str, flags)]
    log = f"{out}.log"
    with open(log, "w") as f:
        job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        stopped, deadline = None, time.monotonic() + 120
        while job.poll() is None and time.monotonic() < deadline:
            if stopped is None and "CAPSTONE_FAULT: stopping this rank" in open(log).read():
                stopped = time.monotonic()
            time.sleep(0.05)
        assert job.poll() is not None, f"the job did not end within 120 s:\n{open(log).read()[-3000:]}"
        text = open(log).read()
        assert stopped is not None, f"the stop never happened:\n{text[-3000:]}"
        return job.returncode, text, time.monotonic() - stopped
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
        for f in pids.iterdir():   # a leftover stopped rank must never outlive the test
            try:
                os.kill(int(f.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass


def assert_named(rc: int, text: str, ended: float, what: str, step, timeout: float = TIMEOUT_S) -> None:
    lines = [ln for ln in text.splitlines() if "capstone: collective timeout" in ln]
    print(f"stop -> job ended after {ended:.1f} s (exit {rc}):\n" + "\n".join(lines))
    assert rc != 0 and lines, text[-3000:]
    at = f"at step {step}" if step != "start-up" else "at start-up"
    assert any(what in ln and at in ln for ln in lines), lines
    assert ended <= timeout + SLACK_S, f"the job took {ended:.1f} s after the stop (timeout {timeout} s)"


# The pipeline alone (2 ranks, no data parallelism): with a second replica its stage 0 would wait for
# rank 0 in the gradient's reduce-scatter, a deadline that races the receive's to the abort.
@pytest.mark.parametrize("kind, ranks, flags, what", [
    ("reduce_scatter", 4, ("--no-overlap",), "reduce-scatter of the gradient at"),
    ("reduce_scatter", 4, ("--bucket-mb", "0.01"), "reduce-scatter of the gradient (7 buckets"),
    ("alltoall", 4, ("--deterministic", "--grad-accum", "2"), "deterministic exchange of a micro-batch's gradient"),
    ("allreduce_stats", 4, (), "allreduce of the gradient norm and loss"),
    ("allreduce_eval", 4, (), "allreduce of the held-out loss"),
    ("allgather", 4, (), "allgather of the updated parameters"),
    ("reduce_scatter", 4, ("--zero-stage", "2", "--bucket-mb", "0.01"), "reduce-scatter of a gradient bucket (ZeRO-2)"),
    ("allgather_params", 4, ("--zero-stage", "3"), "allgather of the parameters of embed (ZeRO-3)"),
    ("send", 2, ("--pp", "2", "--grad-accum", "2"), "pipeline receive of micro-batch 0's gradient from stage 1"),
], ids=["one-shot-reduce", "bucketed-reduce", "deterministic-exchange", "stats-allreduce", "eval-allreduce",
        "parameter-allgather", "zero2-progressed-reduce", "zero3-prefetched-gather", "pipeline-message"])
def test_a_rank_stopped_before_a_collective_ends_the_job(tmp_path, kind, ranks, flags, what):
    """Rank 1 stops itself (SIGSTOP) at step 3 right before it would take part in the collective;
    the others wait in it until the deadline, which names it and the step; the last checkpoint
    (step 2) still verifies. Synchronous checkpoints: the subject is the step's collectives, and in
    the background the write of step 2 may still be in flight when rank 1 stops, so that it is never
    published (tests/test_async_checkpoints.py; a stop inside a background save: below)."""
    out = tmp_path / "run"
    rc, text, ended = stopped_job(out, ranks, f"stop:1:3:{kind}", "--steps", "6", "--no-ckpt-async", *flags)
    assert_named(rc, text, ended, what, 3)
    assert (out / "checkpoints" / "latest").read_text().strip() == "ckpt-00000002.h5"
    inspect_ok(out / "checkpoints" / "ckpt-00000002.h5")


def test_a_rank_stopped_in_a_checkpoint_save_ends_the_job_and_never_publishes_it(tmp_path):
    """At the save of step 4 rank 1 stops before the collective parallel-HDF5 open; the others are
    inside it, holding the GIL in MPI-IO, where only the watchdog process can end the wait: it
    prints the line and kills its rank, the job ends. Checkpoint 4 is never published. (The save is
    written in the background, --ckpt-async: the open is the writer thread's, under its own
    deadline's watchdog.)"""
    out = tmp_path / "run"
    rc, text, ended = stopped_job(out, 4, "stop:1:4:blocking", "--steps", "6")
    assert_named(rc, text, ended, "parallel HDF5 open of ckpt-00000004.h5.partial-", 4)
    assert (out / "checkpoints" / "latest").read_text().strip() == "ckpt-00000002.h5"
    assert not (out / "checkpoints" / "ckpt-00000004.h5").exists()
    inspect_ok(out / "checkpoints" / "ckpt-00000002.h5")


def test_a_rank_stopped_while_loading_a_checkpoint_ends_the_job(tmp_path):
    """A resume: rank 1 stops before the collective read of the checkpoint; the job ends at the
    start-up deadline (the floor, made short here by CAPSTONE_DEADLINE_FLOOR_S) naming the read."""
    out = tmp_path / "run"
    assert subprocess.run(["mpirun", "-n", "4", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out",
                           str(out), "--steps", "4", "--ckpt-every", "2", "--quiet"], env=mpi_env(), cwd=ROOT,
                          capture_output=True, timeout=120).returncode == 0
    rc, text, ended = stopped_job(out, 4, "stop:1:0:load", "--steps", "6", "--resume", "latest",
                                  env={"CAPSTONE_DEADLINE_FLOOR_S": str(TIMEOUT_S)})
    assert_named(rc, text, ended, "parallel HDF5 open of ckpt-00000004.h5", "start-up")
    inspect_ok(out / "checkpoints" / "ckpt-00000004.h5")


def test_start_up_waits_at_least_the_floor(tmp_path):
    """Before the first step the deadline is at least the floor (rank 0 may be verifying a large
    checkpoint while the others wait): with --collective-timeout 1 and the floor at 4 s, a rank
    stopped at start-up ends the job after about 4 s, not 1, and the message says so."""
    out = tmp_path / "run"
    rc, text, ended = stopped_job(out, 4, "stop:1:0:start", "--steps", "4", timeout=1,
                                  env={"CAPSTONE_DEADLINE_FLOOR_S": "4"})
    assert_named(rc, text, ended, "", "start-up", timeout=4)
    assert ended >= 3.5, f"the start-up deadline was {ended:.1f} s, below the floor"
    assert "start-up timeout 4 s = max(--collective-timeout 1, floor 4 s)" in text


def test_the_automatic_deadline_follows_the_longest_step(tmp_path):
    """No --collective-timeout: the deadline is max(floor, 20 x the longest step). With steps of about
    0.25 s (--sleep-per-step) and the floor at 2 s, a rank stopped at step 4 ends the job after 20 x
    the longest step, and the message gives that number: at least 20 x the longest step rank 0 logged
    (its loop adds the log to the step), at most what a loaded machine's slowest step could make it."""
    out = tmp_path / "run"
    env = {"CAPSTONE_DEADLINE_FLOOR_S": "2"}
    rc, text, ended = stopped_job(out, 4, "stop:1:4:allreduce_stats", "--steps", "6", "--sleep-per-step", "0.25",
                                  timeout=0, env=env)
    line = next(ln for ln in text.splitlines() if "collective timeout" in ln)
    seconds = float(line.split("automatic timeout ")[1].split(" s")[0])
    print(line)
    longest = max(r["step_ms"] for r in map(json.loads, open(out / "metrics.jsonl")) if "step_ms" in r) / 1000
    assert "= max(2 s, 20 x longest step)" in line and max(5, 20 * longest) <= seconds + 0.5 <= 25.5, (line, longest)
    assert seconds - 1 <= ended <= seconds + SLACK_S, (ended, seconds)


def test_tp_allreduce_of_a_stopped_rank_ends_the_job(tmp_path):
    """--tp 2 on 2 ranks: rank 1 stops (SIGSTOP) at the start of step 3; its tensor-parallel partner
    waits in the first block's allreduce, which the deadline ends with a message naming it (issue 24:
    tensor parallelism used to ignore --collective-timeout and hang). Two ranks, no second replica:
    with 4 ranks the other replica's reduce-scatter of step 3 could time out first and end the job
    before rank 0 names its own wait."""
    rc, text, ended = stopped_job(tmp_path / "tp", 2, "stop:1:3", "--tp", "2", "--steps", "6", "--no-ckpt-async")
    assert_named(rc, text, ended, "tensor-parallel allreduce of a block's output", 3)
    assert (tmp_path / "tp" / "checkpoints" / "latest").read_text().strip() == "ckpt-00000002.h5"


def test_a_stopped_cp_rank_ends_the_job_naming_the_rings_message(tmp_path):
    """--cp 4: rank 1 stops (SIGSTOP) at the start of step 3; the next rank of the ring waits for its
    keys and values in the first block's ring attention, the rank before it (past MPI's eager size)
    for its send to rank 1: the deadline ends the job with a message naming the ring's message and
    the stopped rank, whichever of the two reports first (synchronous checkpoints, as above)."""
    rc, text, ended = stopped_job(tmp_path / "cp", 4, "stop:1:3", "--cp", "4", "--steps", "6", "--no-ckpt-async")
    assert_named(rc, text, ended, "context-parallel ring attention: keys and values of hop 0 ", 3)
    named = [ln for ln in text.splitlines() if "capstone: collective timeout" in ln]
    hop0 = [ln for ln in named if "of hop 0 " in ln]   # a later hop's wait (rank 3's) is a consequence
    assert hop0 and all(re.search(r"of hop 0 (from|to) cp rank 1 at step 3", ln) for ln in hop0), named
    assert (tmp_path / "cp" / "checkpoints" / "latest").read_text().strip() == "ckpt-00000002.h5"


# ---- the overlapped reduce-scatter, end to end (it shares the step's collectives with the timeout) ----
def test_overlap_and_no_overlap_train_alike(tmp_path, run_train):
    """Buckets started during backward (small buckets, --grad-accum 2: only the last micro-batch
    may start them) give the --no-overlap run's losses and parameters: bit for bit, and within
    rtol 1e-6 as the acceptance bound; both pass every invariant. Both are given the small buckets:
    --no-overlap must still reduce in one call after the backward."""
    import numpy as np

    from conftest import by_step, step_rows, summary
    runs = {}
    for name, flags in (("overlap", ["--bucket-mb", "0.01"]), ("no-overlap", ["--bucket-mb", "0.01", "--no-overlap"])):
        out = tmp_path / name
        p = run_train(4, "--out", out, "--grad-accum", 2, "--steps", 10, "--quiet", *flags)
        assert p.returncode == 0, p.stdout + p.stderr
        s = summary(out)
        assert s["status"] == "completed" and all(v["ok"] for v in s["invariants"].values()), s["invariants"]
        runs[name] = by_step(out)
    a, b = runs["overlap"], runs["no-overlap"]
    assert sorted(a) == sorted(b) == list(range(1, 11))
    from capstone.config import ModelConfig
    from capstone.model.params import Layout
    from capstone.parallel.buckets import plan
    buckets = len(plan(Layout.for_model(ModelConfig(), 4), int(0.01 * 2**20) // 4))
    calls = {name: {r["comm"]["reduce_scatter"]["calls"] for r in step_rows(tmp_path / name)} for name in runs}
    assert buckets == 7 and calls == {"overlap": {buckets}, "no-overlap": {1}}, calls   # the flags are honoured
    np.testing.assert_allclose([a[s][0] for s in a], [b[s][0] for s in a], rtol=1e-6)
    np.testing.assert_allclose([a[s][1] for s in a], [b[s][1] for s in a], rtol=1e-6)
    assert [a[s][2] for s in a] == [b[s][2] for s in a], "parameter fingerprints differ"


@pytest.mark.parametrize("env, dedicated", [({"OMPI_MCA_mpi_oversubscribe": "0"}, True),
                                            ({"OMPI_MCA_mpi_oversubscribe": "1"}, False),
                                            ({"OMPI_MCA_mpi_oversubscribe": "0", "OMPI_MCA_mpi_yield_when_idle": "1"}, False),
                                            ({}, True)])
def test_spin_long_only_when_every_rank_has_a_core(monkeypatch, env, dedicated):
    """Waiting ranks spin 50 ms before sleeping when each has a core (sleeping only adds latency
    there), 2 ms when ranks share cores (a spinner would take a peer's CPU)."""
    from capstone.collective import deadline, launch
    for k in ("OMPI_MCA_mpi_oversubscribe", "OMPI_MCA_mpi_yield_when_idle"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launch.dedicated_cores(2, lambda: 2) is dedicated
    if not env:   # neither flag: the ranks on the node against its CPUs
        assert launch.dedicated_cores(2, lambda: os.cpu_count() + 1) is False
    from capstone.collective import launch
    want = deadline.SPIN_DEDICATED_S if dedicated else deadline.SPIN_S
    assert launch.world().deadline.spin_s == (want if env else deadline.SPIN_DEDICATED_S)
