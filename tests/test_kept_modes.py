"""The run's modes in its checkpoint (issue 35, item 4; capstone.checkpoint.kept): a resume without
the mode flags keeps the checkpoint's ZeRO stage, recompute and grid (tp, pp, schedule), a flag
given wins, a kept grid the ranks cannot hold falls back to one they can and the start says so, and
every change is listed `name: old -> new`. An old checkpoint (no modes) resumes with the defaults.
And the cross-grid proof: a ZeRO-3 pp 2 run stopped and resumed on pp 1 at stage 1 matches the
1-rank run and is bit-identical to a second resume of the same checkpoint on that grid."""

import json
import shutil
import subprocess

import pytest

import composition as mx
from conftest import code_at, mpi_env, mpirun, step_rows, summary
from test_composition import command, launch, references, same_run, shown   # noqa: F401 (a fixture)

BEFORE = "d1f6535"   # main before the modes were kept: its checkpoints have none
SMALL = ("--steps", 6, "--n-layers", 4, "--ckpt-every", 2)


def started(out) -> list[dict]:
    """The `start` rows of a run directory's metrics.jsonl, one per launch."""
    with open(out / "metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if row.get("event") == "start"]


def changed_line(res) -> str:
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("note: resuming with changed settings:")]
    return lines[0] if lines else ""


def stage_and_grid(out) -> tuple:
    s = summary(out)
    return {r["stage"] for r in s["memory"]["per_rank"]}, s["grid"]["tp"], s["grid"]["pp"]


def test_a_resume_without_mode_flags_keeps_the_checkpoints_modes(tmp_path):
    """ZeRO-3 --reshard step, recompute, pp 2 afab 3,1: `--resume latest` with no mode flag keeps them all, and says no
    change; `--resume RUN_DIR` on 1 rank keeps the stage and recompute, and the pipeline, which 1
    rank cannot hold, falls back to pp 1 with the reason on the changed-settings line."""
    out = tmp_path / "run"
    modes = {"zero_stage": 3, "reshard": "step", "recompute": True, "tp": 1, "pp": 2, "pp_schedule": "afab",
             "pp_layers": [3, 1], "guard_undo": True, "det_split": 4, "precision": "fp32"}
    res = mpirun(2, "--out", out, *SMALL, "--zero-stage", 3, "--reshard", "step", "--recompute", "--pp", 2,
                 "--pp-schedule", "afab",
                 "--pp-layers", "3,1", "--grad-accum", 2, "--stop-after", 2)
    assert res.returncode == 0, res.stdout + res.stderr
    res = mpirun(2, "--out", out, "--resume", "latest", "--stop-after", 4)
    assert res.returncode == 0, res.stdout + res.stderr
    assert stage_and_grid(out) == ({3}, 1, 2) and changed_line(res) == "", res.stdout
    assert started(out)[-1]["modes"] == modes
    res = mpirun(1, "--resume", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert stage_and_grid(out) == ({3}, 1, 1)
    assert started(out)[-1]["modes"] == {**modes, "pp": 1, "pp_schedule": None, "pp_layers": None}
    line = changed_line(res)
    assert "pp: 2 -> 1 (the checkpoint's --pp 2 x --tp 1 does not divide the 1 rank; --pp K chooses)" in line, line
    assert "pp_schedule: afab -> none" in line and "pp_layers: 3,1 -> balanced" in line, line
    assert "zero_stage" not in line and "recompute" not in line and "reshard" not in line, line


def test_mode_flags_given_win_and_every_change_is_listed(tmp_path):
    """tp 2 at stage 2 (--reshard step) with recompute, resumed on 2 ranks with --pp 2 --zero-stage 1
    --no-recompute (--resume auto): the flags win; tp 2 x pp 2 does not fit 2 ranks, so the kept tp
    falls back, said; the reshard policy, about ZeRO-2/3, goes back to its default (not refused)."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, *SMALL, "--tp", 2, "--zero-stage", 2, "--reshard", "step", "--recompute",
                 "--grad-accum", 2, "--stop-after", 2)
    assert res.returncode == 0, res.stdout + res.stderr
    res = mpirun(2, "--out", out, "--resume", "auto", "--pp", 2, "--zero-stage", 1, "--no-recompute", "--steps", 4)
    assert res.returncode == 0, res.stdout + res.stderr
    assert stage_and_grid(out) == ({1}, 1, 2)
    assert started(out)[-1]["modes"] == {"zero_stage": 1, "reshard": "micro-batch", "recompute": False, "tp": 1,
                                         "pp": 2, "pp_schedule": None, "pp_layers": None, "guard_undo": True,
                                         "det_split": 4, "precision": "fp32"}
    line = changed_line(res)
    for change in ("zero_stage: 2 -> 1", "reshard: step -> micro-batch", "recompute: True -> False", "pp: 1 -> 2",
                   "steps: 6 -> 4",
                   "tp: 2 -> 1 (the checkpoint's --tp 2 x --pp 2 does not divide the 2 ranks; --tp K chooses)"):
        assert change in line, (change, line)


@pytest.fixture(scope="module")
def before_code(tmp_path_factory):
    return code_at(tmp_path_factory, BEFORE)


def test_a_checkpoint_without_modes_resumes_with_the_defaults(before_code, tmp_path):
    """A checkpoint of the code before (ZeRO-3 and recompute, not recorded) resumes without an error,
    with today's defaults, and lists no mode as changed (the checkpoint does not say what it had)."""
    out = tmp_path / "run"
    old = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", "python", "-m", "capstone.train", "--out", str(out),
                          *map(str, SMALL), "--zero-stage", "3", "--recompute", "--stop-after", "2"],
                         capture_output=True, text=True, timeout=120, env={**mpi_env(), "PYTHONPATH": str(before_code)},
                         cwd=str(before_code))
    assert old.returncode == 0, old.stdout + old.stderr
    assert "modes" not in started(out)[-1]
    res = mpirun(2, "--out", out, "--resume", "latest")
    assert res.returncode == 0, res.stdout + res.stderr
    assert stage_and_grid(out) == ({1}, 1, 1) and changed_line(res) == "", res.stdout
    assert started(out)[-1]["modes"]["zero_stage"] == 1


def test_zero3_pp2_stopped_and_resumed_on_pp1_at_stage_1(references, tmp_path):
    """Issue 35's cross-grid proof at the composition matrix's model: 4 ranks (dp 2 x pp 2) at ZeRO-3
    stopped at step 4, resumed on 2 ranks (dp 2, pp 1) at stage 1: within 1e-5 of the 1-rank run at
    every step, and bit-identical to a second resume of a copy of the same checkpoint on that grid."""
    source = mx.Row(4, 1, 2, True, False, "clean", False, zero=3, pp="2:1f1b")
    target = mx.Row(2, 1, 2, True, False, "clean", False, zero=1)
    stop = [command(4, tmp_path / "run", [*source.flags(), "--stop-after", mx.STOP_AT])]
    res = launch(stop)[-1]
    assert res.returncode == 0, res.stdout + res.stderr
    shutil.copytree(tmp_path / "run", tmp_path / "again")
    again = [[*command(2, tmp_path / name, [*target.flags(), "--pp", 1]), "--resume", "latest"]
             for name in ("run", "again")]
    for cmd in again:
        res = launch([cmd])[-1]
        assert res.returncode == 0, res.stdout + res.stderr
    where = f"zero3-pp2 -> pp1 zero1\n{shown(stop + again)}"
    got = step_rows(tmp_path / "run")
    same_run(got, references("clean"), where)
    keys = ("loss", "grad_norm", "eval_loss", "param_norm", "fingerprint", "accepted", "samples")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in step_rows(tmp_path / "again")]
    assert stage_and_grid(tmp_path / "run") == ({1}, 1, 1)
    assert [row["modes"]["pp"] for row in started(tmp_path / "run")] == [2, 1]


def test_mode_flags_are_judged_over_the_checkpoints_modes(tmp_path):
    """--pp-layers without --pp is refused on a fresh start, but on --resume of a pp 2 checkpoint it
    changes that pipeline's blocks (the pp is the checkpoint's); over a pp 1 checkpoint it is refused
    as before: exit 2, the reason and the flag, once."""
    pp2, pp1 = tmp_path / "pp2", tmp_path / "pp1"
    for out, grid in ((pp2, ("--pp", 2)), (pp1, ())):
        res = mpirun(2, "--out", out, *SMALL, *grid, "--stop-after", 2)
        assert res.returncode == 0, res.stdout + res.stderr
    res = mpirun(2, "--out", pp2, "--resume", "latest", "--pp-layers", "1,3", "--stop-after", 4)
    assert res.returncode == 0, res.stdout + res.stderr
    assert started(pp2)[-1]["modes"]["pp_layers"] == [1, 3] and stage_and_grid(pp2) == ({1}, 1, 2)
    assert "pp_layers: balanced -> 1,3" in changed_line(res), res.stdout
    res = mpirun(2, "--out", pp1, "--resume", "latest", "--pp-layers", "2,2")
    assert res.returncode == 2 and res.stderr.count("error:") == 1, res.stdout + res.stderr
    assert "--pp-layers is about pipeline stages: it needs --pp K > 1" in res.stderr, res.stderr


PLAN_BEFORE = "139b8fc"   # main before the plan (issue 48): its checkpoints' modes came from cli.KEPT


@pytest.fixture(scope="module")
def plan_before_code(tmp_path_factory):
    return code_at(tmp_path_factory, PLAN_BEFORE)


def test_a_checkpoint_of_the_code_before_the_plan_resumes_on_its_grid_and_on_another(plan_before_code, tmp_path):
    """Issue 48: the modes a checkpoint stored before the layout became one Plan (tp 2, ZeRO-2, --reshard step)
    are read by Plan.make: the same grid keeps them all; 2 ranks keep them too (tp 2 fits) with half the global
    batch; the run resumes with its logical digests verified and completes."""
    out = tmp_path / "run"
    old = subprocess.run(["mpirun", "-n", "4", "--oversubscribe", "python", "-m", "capstone.train", "--out", str(out),
                          *map(str, SMALL), "--tp", "2", "--zero-stage", "2", "--reshard", "step", "--grad-accum", "2",
                          "--stop-after", "2"], capture_output=True, text=True, timeout=180,
                         env={**mpi_env(), "PYTHONPATH": str(plan_before_code)}, cwd=str(plan_before_code))
    assert old.returncode == 0, old.stdout + old.stderr
    modes = started(out)[-1]["modes"]
    assert (modes["tp"], modes["zero_stage"], modes["reshard"]) == (2, 2, "step")
    other = tmp_path / "other"
    shutil.copytree(out, other)
    for ranks, where in ((4, out), (2, other)):
        res = mpirun(ranks, "--out", where, "--resume", "latest")
        assert res.returncode == 0 and "logical digests verified" in res.stdout, res.stdout + res.stderr
        now = started(where)[-1]["modes"]   # the modes it kept; --det-split, new since, at its default
        assert {k: now[k] for k in modes} == modes and now["det_split"] == 4 and summary(where)["status"] == "completed"
        assert stage_and_grid(where) == ({2}, 2, 1)
