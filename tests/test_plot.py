"""capstone.runlog and capstone.plot: exact metrics reading on a synthetic run, figures whose curves are the file's
values, a running run, a resumed run (each step once), and real short runs under mpirun."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mpi_env, mpirun

from capstone import plot
from capstone.observe import runlog

# Reading is tested without matplotlib; drawing needs it (pip install matplotlib).
needs_mpl = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")


def step(s, loss, **kw):
    row = {"step": s, "loss": loss, "eval_loss": loss - 0.1, "accepted": True, "grad_norm": 2.0 + s,
           "grad_norm_clipped": 1.5, "lr": 0.01 * s, "tokens": 100, "samples": [0, 8], "step_ms": 10.0,
           "fwd_bwd_ms": 6.0, "comm_ms": 3.0, "reduce_scatter_ms": 2.0, "allgather_ms": 1.0, "optimizer_ms": 0.5,
           "tokens_per_s": 1e4, "param_norm": 1.0, "fingerprint": "f", "events": []}
    row.update(kw)
    return row


def synthetic_lines():
    """Steps 1-5, a rollback at 2, a checkpoint at 3; a crash after 5; a resume from 3 that repeats 4-5
    (new fields: tokens_total, eval_ms, a "comm" dict) and reaches 6; then a partial line (still running)."""
    first = [step(1, 4.9), step(2, 50.0, accepted=False, eval_loss=99.0,
                                events=[{"event": "rollback", "reason": "loss_spike", "step": 2}]),
             step(3, 4.7, events=[{"event": "checkpoint", "path": "ckpt-3"}]), step(4, 4.6), step(5, 4.5)]
    new = dict(eval_ms=0.7, comm={"reduce_scatter": {"ms": 2.5, "bytes": 8}, "allgather": 1.5, "bcast": {"seconds": 1e-3}})
    second = [step(s, 4.0 - 0.1 * s, tokens_total=100 * s, time=1e9 + s, repeat=s < 6, **new) for s in (4, 5, 6)]
    start = {"event": "start", "world": 2, "start_step": 0, "resumed_from": None, "time": 1e9}
    resume = dict(start, start_step=3, resumed_from="ckpt-3")
    return [json.dumps(r) for r in [start, *first, resume, *second]] + ['{"step": 7, "loss": 1.']


SUMMARY = {"status": "completed", "train_config": {"clip": 1.5},
           "memory": {"per_rank": [{"rank": r, "params_bytes": 4096, "gathered_bytes": 2048, "grads_bytes": 8192,
                                    "reduce_bytes": 3072, "optimizer_bytes": 6144, "guard_bytes": 100, "snapshot_bytes": 200, "peak_rss_bytes": 50 << 20} for r in (1, 0)]}}


@pytest.fixture
def syn(tmp_path):
    out = tmp_path / "syn"
    out.mkdir()
    (out / "metrics.jsonl").write_text("\n".join(synthetic_lines()))
    (out / "summary.json").write_text(json.dumps(SUMMARY))
    return out


def lines_of(fig, ax=0) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[ax].get_lines()}


def test_parse_skips_partial_and_garbled_lines():
    records, bad = runlog.parse_lines('{"step": 1}\n\n[1, 2]\n{"step": 2, "lo{"event": "start"}\n{"step": 3}\n{"st')
    assert [r["step"] for r in records] == [1, 3] and bad == 3


def test_reading_dedupes_by_step_latest_row_wins(syn):
    run = runlog.read_run(str(syn))
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4, 5, 6] and run.skipped_lines == 1
    assert [r["loss"] for r in run.rows] == [4.9, 50.0, 4.7, 3.6, 3.5, 3.4]
    assert [r["tokens_total"] for r in run.rows] == [100, 200, 300, 400, 500, 600]  # summed, then given
    assert runlog.series(list(run.rows), "loss", accepted_only=True) == ([1, 3, 4, 5, 6], [4.9, 4.7, 3.6, 3.5, 3.4])
    assert runlog.series(list(run.rows), "eval_loss", "tokens_total")[0] == [100, 200, 300, 400, 500, 600]
    assert runlog.event_steps(list(run.rows), "rollback") == [2] and runlog.event_steps(list(run.rows), "checkpoint") == [3]
    assert runlog.resume_steps(list(run.starts)) == [3] and runlog.clip_level(run) == 1.5
    assert [m["rank"] for m in runlog.memory_rows(run)] == [0, 1]


def test_timing_parts_are_the_phases_and_skip_totals(syn):
    """The stacked phases are the "<phase>_ms" fields (an older run's names too); the "comm" dict's
    collectives happen inside them and are not stacked again."""
    rows = runlog.read_run(str(syn)).rows
    assert runlog.timing_parts(rows[0]) == {"fwd_bwd": 6.0, "reduce_scatter": 2.0, "allgather": 1.0, "optimizer": 0.5}
    assert runlog.timing_parts(rows[-1]) == {"fwd_bwd": 6.0, "reduce_scatter": 2.0, "allgather": 1.0, "optimizer": 0.5,
                                             "eval": 0.7}
    assert runlog.phase_order(list(rows)) == ["fwd_bwd", "optimizer", "eval", "allgather", "reduce_scatter"]
    assert runlog.timing_parts({"comm": {"x": {"seconds": None}, "y": "nan"}, "step_ms": 1.0, "comm_ms": 1.0}) == {}
    new = {"step_ms": 10.0, "fwd_bwd_ms": 6.0, "reduce_ms": 2.0, "optimizer_ms": 1.0, "eval_ms": 0.5, "checks_ms": 0.2}
    assert list(runlog.timing_parts(new)) == ["fwd_bwd", "reduce", "optimizer", "eval", "checks"]
    assert runlog.phase_order([new]) == ["fwd_bwd", "reduce", "optimizer", "eval", "checks"]


def test_values_nulls_and_clip_sources():
    assert [runlog.number(v) for v in (1, "2.5", None, "nan", "inf", True, "x")] == [1.0, 2.5, None, None, None, None, None]
    run = runlog.Run("d", "d", (), ({"event": "start", "train_config": {"clip": 0.5}},), None, 0)
    assert runlog.clip_level(run) == 0.5
    assert runlog.clip_level(runlog.Run("d", "d", (), run.starts, {"train_config": {"clip": 1.5}}, 0)) == 0.5
    assert runlog.clip_level(runlog.Run("d", "d", (), (), {"train_config": {"clip": 0.0}}, 0)) is None


@needs_mpl
def test_figures_plot_the_file_values(syn, tmp_path):
    figs = plot.make_figures([runlog.read_run(str(syn))])
    assert set(figs) == {"loss_step", "loss_tokens", "grad_norm", "lr", "step_time", "memory"}
    loss = lines_of(figs["loss_step"])
    assert loss["syn train"] == ([1, 3, 4, 5, 6], [4.9, 4.7, 3.6, 3.5, 3.4])
    assert loss["syn held-out"][1] == pytest.approx([4.8, 4.6, 3.5, 3.4, 3.3])
    assert loss["syn resume"][0] == [3, 3] and loss["syn rollback"][0] == [2, 2]
    assert lines_of(figs["loss_tokens"])["syn train"][0] == [100, 300, 400, 500, 600]
    assert lines_of(figs["loss_tokens"])["syn resume"][0] == [300, 300]
    grad = lines_of(figs["grad_norm"])
    assert grad["syn grad norm"] == ([1, 2, 3, 4, 5, 6], [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) and grad["syn clip 1.5"][1] == [1.5, 1.5]
    assert lines_of(figs["lr"])["syn"][1] == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05, 0.06])
    assert lines_of(figs["step_time"])["step_ms (measured total)"][1] == [10.0] * 6
    mem = figs["memory"].axes[0]
    assert [t.get_text() for t in mem.get_xticklabels()] == ["0", "1"]
    assert [p.get_height() for p in mem.patches] == [4.0, 4.0, 2.0, 2.0, 8.0, 8.0, 3.0, 3.0, 6.0, 6.0, 100 / 1024, 100 / 1024, 200 / 1024,
                                                  200 / 1024]  # KiB
    paths = plot.save_figures(figs, str(tmp_path / "png"))
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 10_000, p


@needs_mpl
def test_cli_on_a_running_run(syn, tmp_path, capsys):
    os.remove(syn / "summary.json")
    assert plot.main([str(syn), "--out", str(tmp_path / "png")]) == 0
    assert sorted(os.listdir(tmp_path / "png")) == ["grad_norm.png", "loss_step.png", "loss_tokens.png", "lr.png",
                                                    "step_time.png"]  # memory needs summary.json
    assert "6 steps, running or stopped (no summary.json yet), 1 unparsable line(s) skipped" in capsys.readouterr().out


def test_cli_errors(tmp_path, syn, monkeypatch, capsys):
    assert plot.main([str(tmp_path / "nope")]) == 2 and "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"event": "start", "start_step": 0}\n')
    assert plot.main([str(tmp_path / "empty")]) == 2 and "nothing to plot" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert plot.main([str(syn)]) == 2 and "pip install matplotlib" in capsys.readouterr().err


def test_out_that_is_a_file_is_a_clean_error(tmp_path, syn, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("mine")
    assert plot.main([str(syn), "--out", str(readme)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out") and "not a directory" in err and readme.read_text() == "mine"
    res = subprocess.run([sys.executable, "-m", "capstone.plot", str(syn), "--out", str(readme)], capture_output=True,
                         text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "FileExistsError" not in res.stderr


@needs_mpl
def test_a_reader_that_leaves_early_is_no_error(tmp_path, syn):
    """`plot RUN | head -1`: the pipe's reader is gone before the first line; no BrokenPipeError, figures written."""
    read, write = os.pipe()
    os.close(read)                                  # every write to the pipe now fails with EPIPE
    try:
        res = subprocess.run([sys.executable, "-m", "capstone.plot", str(syn), "--out", str(tmp_path / "png")],
                             stdout=write, stderr=subprocess.PIPE, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    finally:
        os.close(write)
    assert res.returncode == 141 and res.stderr == "", res.stderr      # 128 + SIGPIPE, as every tool (capstone.flags.pipe)
    assert "loss_step.png" in os.listdir(tmp_path / "png")
    shell = subprocess.run(f"{sys.executable} -m capstone.plot {syn} --out {tmp_path / 'png2'} | head -1", shell=True,
                           capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert shell.stdout.count("\n") == 1 and shell.stderr == ""


def test_runs_with_one_name_are_told_apart():
    assert runlog.run_labels(["a/run", "b/run/", "c"]) == ["a/run", "b/run", "c"]


def test_training_and_reading_do_not_import_matplotlib():
    code = "import sys, capstone.train, capstone.observe.runlog, capstone.plot, capstone.observe.accounting; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=mpi_env(), cwd=ROOT).returncode == 0


# ---- real runs (mpirun, 2 ranks, 6 steps) ------------------------------------------------------
def metrics_steps(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "event" not in r]


@needs_mpl
def test_real_run(tmp_path):
    out = tmp_path / "n2"
    res = mpirun(2, "--out", out, "--steps", 6, "--ckpt-every", 3, "--quiet")
    assert res.returncode == 0, res.stderr
    rows = metrics_steps(out)
    figs = plot.make_figures([runlog.read_run(str(out))])
    assert lines_of(figs["loss_step"])["n2 train"] == ([r["step"] for r in rows], [r["loss"] for r in rows])
    assert lines_of(figs["loss_step"])["n2 held-out"][1] == [r["eval_loss"] for r in rows]
    assert lines_of(figs["grad_norm"])["n2 grad norm"][1] == [r["grad_norm"] for r in rows]
    assert lines_of(figs["step_time"])["step_ms (measured total)"][1] == [r["step_ms"] for r in rows]
    assert len(figs["memory"].axes[0].patches) == 2 * len(plot.MEMORY)  # 2 ranks x each kind of state
    assert plot.main([str(out), "--out", str(tmp_path / "png")]) == 0
    assert all(os.path.getsize(tmp_path / "png" / f"{name}.png") > 10_000 for name in figs)


@needs_mpl
def test_real_resumed_run_plots_each_step_once(tmp_path):
    """Stop after 3, resume, crash in step 5 (step 4 already written), resume again from 3:
    metrics.jsonl holds step 4 twice, the plot once, with the latest value."""
    out, args = tmp_path / "res", ("--steps", 6, "--ckpt-every", 3, "--quiet")
    assert mpirun(2, "--out", out, "--stop-after", 3, *args).returncode == 0
    crash = mpirun(2, "--out", out, "--resume", "latest", *args, env_extra={"CAPSTONE_FAULT": "raise_in_step:1:5"})
    assert crash.returncode != 0
    res = mpirun(2, "--out", out, "--resume", "latest", *args)
    assert res.returncode == 0, res.stderr
    raw = metrics_steps(out)
    assert [r["step"] for r in raw] == [1, 2, 3, 4, 4, 5, 6]
    latest = {r["step"]: r for r in raw}
    x, y = lines_of(plot.make_figures([runlog.read_run(str(out))])["loss_step"])["res train"]
    assert x == [1, 2, 3, 4, 5, 6] and y == [latest[s]["loss"] for s in x]
    assert runlog.resume_steps(list(runlog.read_run(str(out)).starts)) == [3, 3]


@needs_mpl
def test_plot_while_the_run_is_still_writing(tmp_path):
    out = tmp_path / "live"
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, "-m", "capstone.train", "--out", str(out),
           "--steps", "8", "--sleep-per-step", "0.4", "--quiet"]
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not (out / "metrics.jsonl").exists() or len(runlog.read_run(str(out)).rows) < 2):
            time.sleep(0.1)
        assert plot.main([str(out), "--out", str(tmp_path / "png")]) == 0
        assert not (out / "summary.json").exists(), "the run finished before the plot: make it slower"
        assert not (tmp_path / "png" / "memory.png").exists() and (tmp_path / "png" / "loss_step.png").exists()
    finally:
        assert proc.wait(timeout=120) == 0

