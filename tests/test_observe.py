"""Issue 14, "See the run": the long-run console (--log-every), the step rows' time / tokens_total /
eval_ms / repeat / comm fields, the collectives' byte counts against the nccl-tests formulas at 1, 3
and 4 ranks, the ZeRO what-if in summary.json, provenance in summary.json and in a checkpoint."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from capstone.observe import accounting as acc
from capstone.observe import report, runlog
from capstone.observe.accounting import Collective

from conftest import ROOT, mpi_env, mpirun, summary

ROW = re.compile(r"^\s*(\d+)\s")


def step_rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "event" not in r]


def start_rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("event") == "start"]


def printed_steps(stdout: str) -> dict[int, str]:
    """The console's step lines (between the header and the final report): step -> line."""
    body = stdout.split("\nmemory per rank")[0].splitlines()
    return {int(ROW.match(line).group(1)): line for line in body if ROW.match(line)}


# ---- console ------------------------------------------------------------------------------------
def test_log_every_default():
    assert [report.log_every(0, n) for n in (1, 20, 100, 101, 200, 1000, 100_000)] == [1, 1, 1, 2, 4, 20, 2000]
    assert report.log_every(7, 20) == 7 and report.log_every(1, 10_000) == 1


def test_duration_format():
    assert [report.duration(s) for s in (0.04, 59.9, 245, 7620, float("inf"))] == ["0.0s", "59.9s", "4m05s", "2h07m", "-"]


def test_console_lines_ema_and_events():
    c = report.Console(every=4, steps=10, start_step=0)

    def row(step, loss, accepted=True, events=()):
        return {"step": step, "loss": loss, "eval_loss": None, "accepted": accepted, "tokens": 64, "events": list(events),
                "lr": 1e-2}
    got = {s: c.line(row(s, *args)) for s, *args in [(1, 2.0), (2, 4.0), (3, 100.0, False, [{"event": "rollback"}]),
                                                     (4, 4.0), (5, 1.0), (10, 1.0)]}
    assert [s for s, line in got.items() if line] == [1, 3, 4, 10]  # first, an event, every 4th, the last
    ema = (0.9 * 0.1 * 2.0 + 0.1 * 4.0) / (1 - 0.9 ** 2)  # the rolled-back loss is left out
    assert got[3].split()[:3] == ["3", f"{ema:.5f}", "-"] and got[3].rstrip().endswith("rollback")
    assert "loss_ema" in c.header() and "every 4 steps" in c.header()
    assert report.Console(1, 20, 0).header() == report.step_header()


def test_long_run_console_stays_short(tmp_path):
    """200 steps: the default K is 4, so about 50 lines plus the events (checkpoints every 30 steps) and
    the evaluations (every 10 steps: each is printed, issue 28)."""
    out = tmp_path / "long"
    res = mpirun(1, "--out", out, "--steps", 200, "--ckpt-every", 30, "--eval-every", 10)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = printed_steps(res.stdout)
    ckpts = {30, 60, 90, 120, 150, 180, 200}
    assert set(lines) == {1} | set(range(4, 201, 4)) | ckpts | set(range(10, 201, 10))   # + checkpoints, evaluations
    assert all(lines[s].rstrip().endswith("checkpoint") for s in ckpts)
    assert "loss_ema" in res.stdout and "EMA" in res.stdout
    for s in (40, 200):  # held-out loss where it was measured, "-" elsewhere; elapsed and ETA
        step, ema, held, lr, rate, elapsed, eta = lines[s].split()[:7]
        assert held != "-" and float(lr) == 1e-2 and float(rate) > 0 and elapsed.endswith("s") and eta.endswith("s")
    assert lines[4].split()[2] == "-"
    assert len(res.stdout.splitlines()) < 120  # the whole output, final report included

    rows = step_rows(out)  # every step is still in metrics.jsonl, with the new fields
    assert [r["step"] for r in rows] == list(range(1, 201))
    times, totals = [r["time"] for r in rows], [r["tokens_total"] for r in rows]
    assert times == sorted(times) and totals == [r["step"] * r["tokens"] for r in rows]
    assert all(r["repeat"] is False and r["eval_ms"] > 0 for r in rows)   # the update's verdict, every step
    assert all((r["eval_loss"] is not None) == (r["step"] % 10 == 0 or r["step"] in ckpts) for r in rows)


# ---- the reference run: table unchanged, the new fields, the collectives at 4 ranks ---------------
def test_reference_table_is_unchanged(reference):
    out, res, s = reference
    lines = res.stdout.splitlines()
    assert lines[1] == report.step_header()
    steps = printed_steps(res.stdout)
    assert list(steps) == list(range(1, 21))
    cols = [line.split() for line in steps.values()]
    assert all(len(c) == 8 for c in cols[:9]) and cols[9][-1] == "checkpoint" and len(cols[9]) == 9


def check_comm(out, world: int) -> None:
    """Every row's collectives: S = the whole buffer (nccl-tests), algbw = S / t, busbw = algbw * factor;
    each waited for inside the step (one rank has no allgather to make)."""
    s = summary(out)
    padded = s["padded"]
    want = {"reduce_scatter": ("reduce_scatter", 4 * padded), "allgather": ("allgather", 4 * padded),
            "allreduce_stats": ("allreduce", 8 * 5), "allreduce_eval": ("allreduce", 8 * 2),
            "allgather_checks": ("allgather", 8 * 3 * world)}
    if world == 1:
        del want["allgather"]
    rows = step_rows(out)
    for r in rows:
        assert set(r["comm"]) == set(want), r["comm"]
        for name, (op, nbytes) in want.items():
            e = r["comm"][name]
            assert (e["op"], e["bytes"], e["ranks"], e["calls"]) == (op, nbytes, world, 1)
            assert 0 < e["ms"] < r["step_ms"]
            assert e["algbw_GBps"] == pytest.approx(nbytes / (e["ms"] / 1e3) / 1e9)
            assert e["busbw_GBps"] == pytest.approx(e["algbw_GBps"] * acc.BUS_FACTORS[op](world))
            assert e["sent_bytes_per_rank"] == pytest.approx(nbytes * acc.BUS_FACTORS[op](world))
        assert sum(r[f"{p}_ms"] for p in ("fwd_bwd", "reduce", "optimizer", "eval", "checks")) <= r["step_ms"]
    for name, (op, nbytes) in want.items():  # the summary: medians over steps 2..
        e = s["comm"][name]
        assert (e["bytes"], e["steps"], e["timed_steps"]) == (nbytes, len(rows), len(rows) - 1)
        median = sorted(r["comm"][name]["ms"] for r in rows[1:])
        assert median[0] <= e["median_ms"] <= median[-1]
        assert e["algbw_GBps"] == pytest.approx(Collective(op, nbytes // (4 if op != "allreduce" else 8),
                                                           4 if op != "allreduce" else 8, world,
                                                           e["median_ms"] / 1e3).algbw / 1e9)


def check_what_if(out, world: int) -> None:
    s = summary(out)
    w, P = s["zero_what_if"], s["padded"]
    assert (w["P"], w["n_params"], w["world"], w["precision"]) == (P, s["n_params"], world, "fp32")
    assert [(x["stage"], x["params_bytes"], x["grads_bytes"], x["optimizer_bytes"], x["total_bytes"]) for x in w["stages"]] == [
        (0, 4 * P, 4 * P, 12 * P, 20 * P),
        (1, 4 * P, 4 * P, 12 * P // world, 8 * P + 12 * P // world),
        (2, 4 * P, 4 * P // world, 12 * P // world, 4 * P + 16 * P // world),
        (3, 4 * P // world, 4 * P // world, 12 * P // world, 20 * P // world)]
    stage1, m = w["stages"][1], w["measured"]
    assert m["params_bytes"] == stage1["params_bytes"] and m["optimizer_bytes"] == stage1["optimizer_bytes"]
    staging = 4 * P if world in (4, 8) else 0   # the bit-reversed reduce-scatter's copy (capstone.parallel.buckets)
    assert m["reduce_bytes"] == 4 * P // world + staging
    assert m["grads_bytes"] == stage1["grads_bytes"] and m["stage"] == 1
    assert w["formula"] == {k: m[k] for k in w["formula"]} and "reduce_bytes" in w["formula"]


def test_reference_collectives_and_what_if(reference):
    out, res, _ = reference
    check_comm(out, 4)
    check_what_if(out, 4)
    assert "ZeRO what-if, fp32" in res.stdout and "measured (max over ranks)" in res.stdout
    assert re.search(r"^reduce_scatter\s+reduce_scatter\s+120576\s", res.stdout, re.M)
    assert re.search(r"^allreduce_stats\s+allreduce\s+40\s", res.stdout, re.M)


@pytest.mark.parametrize("n", [1, 3])
def test_collectives_and_what_if_at_other_world_sizes(tmp_path, n):
    out = tmp_path / f"n{n}"
    res = mpirun(n, "--out", out, "--steps", 4, "--ckpt-every", 0, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary(out)["padded"] % n == 0
    check_comm(out, n)
    check_what_if(out, n)


# ---- resume: repeated steps are marked, plots and tokens_total see each step once ------------------
def test_resumed_run_marks_repeats(tmp_path):
    """Checkpoint at 5, crash in step 8 (6 and 7 written), resume: 6 and 7 are written again as repeats."""
    out, args = tmp_path / "rep", ("--steps", 10, "--ckpt-every", 5, "--quiet")
    crash = mpirun(2, "--out", out, *args, env_extra={"CAPSTONE_FAULT": "raise_in_step:0:8"})
    assert crash.returncode != 0
    res = mpirun(2, "--out", out, "--resume", "latest", *args)
    assert res.returncode == 0, res.stdout + res.stderr
    raw = step_rows(out)
    assert [(r["step"], r["repeat"]) for r in raw] == [(s, False) for s in range(1, 8)] + [(6, True), (7, True)] + [
        (s, False) for s in (8, 9, 10)]
    first = {r["step"]: r for r in raw[:7]}
    assert all(r["tokens_total"] == first[r["step"]]["tokens_total"] for r in raw[7:9])  # the same samples again
    run = runlog.read_run(str(out))
    assert [r["step"] for r in run.rows] == list(range(1, 11)) and [r["repeat"] for r in run.rows][5:7] == [True, True]
    totals = [r["tokens_total"] for r in run.rows]
    assert totals == sorted(totals) and len(set(totals)) == 10
    if importlib.util.find_spec("matplotlib") is not None:
        from capstone import plot
        fig = plot.make_figures([run])["loss_step"]
        xs = list(next(line for line in fig.axes[0].get_lines() if line.get_label() == "rep train").get_xdata())
        assert xs == list(range(1, 11))


# ---- provenance -----------------------------------------------------------------------------------
def in_git_repo() -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def test_provenance_in_summary_start_row_and_checkpoint(reference):
    out, _, s = reference
    p = s["provenance"]
    assert p["orig_argv"][-3:] == ["capstone.train", "--out", str(out)] and p["argv"][1:] == ["--out", str(out)]
    for key in ("python", "numpy", "mpi4py", "h5py", "autograd", "mpi_library", "hdf5"):
        assert p["versions"][key], key
    import h5py
    import numpy
    assert p["versions"]["numpy"] == numpy.__version__ and p["versions"]["hdf5"] == h5py.version.hdf5_version
    assert len(p["hosts"]) == 4 and all(p["hosts"])
    commit = in_git_repo()
    if commit is not None:
        assert p["git"]["commit"] == commit and isinstance(p["git"]["dirty"], bool)
    assert start_rows(out)[0]["provenance"] == p
    ckpt = os.path.join(out, "checkpoints", "ckpt-00000020.h5")
    res = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "inspect", "--json", ckpt],
                         capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["provenance"] == p


def test_provenance_without_git(tmp_path, monkeypatch):
    from capstone.observe import provenance
    assert provenance.git_info(str(tmp_path)) == {"commit": None, "dirty": None}  # not a repository
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert provenance.git_info() == {"commit": None, "dirty": None}


# ---- --tensorboard (optional) ---------------------------------------------------------------------
def has_writer() -> bool:
    from capstone.observe import tensorboard
    return tensorboard.writer_class() is not None


@pytest.mark.skipif(has_writer(), reason="tensorboardX or torch is installed")
def test_tensorboard_without_the_package_says_how_to_install(tmp_path):
    res = mpirun(2, "--out", tmp_path / "tb", "--steps", 2, "--tensorboard", tmp_path / "tb" / "board")
    assert res.returncode == 2 and "pip install tensorboardX" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "tb").exists(), "no half-made run directory"


def read_scalars(directory) -> dict:
    """tag -> [(step, value)] of the event files in `directory` (TFRecord framing, tensorboardX's protos)."""
    import struct

    from tensorboardX.proto import event_pb2
    out = {}
    for name in sorted(os.listdir(directory)):
        data, pos = (directory / name).read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


@pytest.mark.skipif(not importlib.util.find_spec("tensorboardX"), reason="tensorboardX is not installed")
def test_tensorboard_scalars_are_the_metrics(tmp_path):
    out = tmp_path / "tb"
    res = mpirun(2, "--out", out, "--steps", 3, "--quiet", "--tensorboard", out / "board")
    assert res.returncode == 0, res.stdout + res.stderr
    scalars, rows = read_scalars(out / "board"), step_rows(out)
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert [s for s, _ in scalars["comm/reduce_scatter_busbw_GBps"]] == [1, 2, 3]
    assert {"eval/loss", "perf/tokens_per_s", "time/fwd_bwd_ms", "comm/allgather_algbw_GBps"} <= set(scalars)


def test_quiet_prints_the_result_in_one_line(tmp_path):
    """--quiet: no banner, no report; the result's line (a stopped run's says how to continue)."""
    quiet = mpirun(2, "--out", tmp_path / "quiet", "--steps", 4, "--ckpt-every", 2, "--quiet")
    assert quiet.returncode == 0 and quiet.stdout.splitlines() == [
        f"completed step 4 in {quiet.stdout.split(' in ')[1].split(' s;')[0]} s; summary {tmp_path}/quiet/summary.json"]
    stopped = mpirun(2, "--out", tmp_path / "quiet", "--steps", 8, "--resume", "latest", "--stop-after", 6, "--quiet")
    assert stopped.returncode == 0 and len(stopped.stdout.splitlines()) == 1, stopped.stdout
    assert stopped.stdout.startswith("preempted step 6") and "--resume latest" in stopped.stdout
