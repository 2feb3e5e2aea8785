"""Issue 35's modes tried as a new user would: the rough edges found and fixed. A --deterministic
run resumes without it (--no-deterministic, as --no-recompute and --guard-undo undo theirs); --help
names stage 0 and tensor parallelism at any stage; `checkpoint inspect` shows the modes a resume
keeps; --deterministic with --reshard step says what the policy still does."""

import json

import pytest

from capstone.checkpoint.__main__ import manifest
from capstone.cli import build_parser, parse
from conftest import mpirun


def test_no_deterministic_turns_a_kept_deterministic_off():
    """The checkpoint's settings win on --resume: without a negative flag a --deterministic run could
    never resume in the default (bucketed, overlapped) mode."""
    saved = {"deterministic": True}
    assert parse(["--resume", "latest", "--out", "runs/x"]).on_top_of({}, saved).train.deterministic is True
    assert parse(["--resume", "latest", "--out", "runs/x", "--no-deterministic"]).on_top_of({}, saved).train.deterministic is False
    assert parse(["--no-deterministic"]).train.deterministic is False


def test_help_names_stage_0_and_tp_at_any_stage():
    text = " ".join(build_parser().format_help().split())
    assert "ZeRO stages 0-3" in text, "the description names stage 0"
    assert "run ZeRO-1 data parallelism" not in text, "--tp runs with any --zero-stage"
    assert "--no-deterministic" in text and "on --resume: the checkpoint's)" in text
    assert "at --zero-stage 0 an allreduce" in text, "--no-overlap at stage 0"


def meta(modes=None) -> dict:
    m = {"format_version": 2, "step": 4, "world_size": 4, "n_params": 10, "padded": 12, "adam_t": 4,
         "run": {"data_cursor": 64}, "model_config": {"n_layers": 2}, "datasets": {}, "logical_sha256": {}}
    return {**m, "modes": modes} if modes is not None else m


def test_inspect_prints_the_modes_a_resume_keeps(capsys):
    modes = {"guard_undo": False, "pp": 2, "pp_layers": None, "pp_schedule": "afab", "recompute": True,
             "reshard": "step", "tp": 1, "zero_stage": 3}   # as the checkpoint stores them: sorted JSON
    manifest("ckpt.h5", meta(modes))
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  modes ")]
    assert line == ["  modes zero_stage 3, reshard step, recompute True, tp 1, pp 2, pp_schedule afab, "
                    "pp_layers balanced, guard_undo False"], line
    manifest("old.h5", meta())
    assert "  modes none recorded" in capsys.readouterr().out


@pytest.mark.parametrize("stage,says", [(2, "it changes nothing"), (3, "only the gathered parameters stay")])
def test_deterministic_reshard_step_says_what_it_keeps(tmp_path, stage, says):
    """--deterministic exchanges each micro-batch's gradient as it is made (its memory formula has no
    whole gradient under --reshard step): the start says so, once, instead of a silent no-op."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--deterministic", "--zero-stage", stage, "--reshard", "step", "--grad-accum", 2,
                 "--steps", 1, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    notes = [ln for ln in res.stdout.splitlines() if "--reshard step keeps no whole gradient" in ln]
    assert len(notes) == 1 and says in notes[0], res.stdout
    with open(out / "summary.json") as f:
        assert json.load(f)["status"] == "completed"
