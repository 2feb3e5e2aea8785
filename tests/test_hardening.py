"""Issue-9 details that long runs meet: defaults, a short report, config errors, --help."""

import h5py
import json

from conftest import mpirun, summary

from capstone.cli import build_parser
from capstone.config import TrainConfig


def test_long_run_defaults_keep_few_checkpoints_without_history(reference):
    """Keep the last 3 (and the run's first), a wall-clock interval, no loss history inside."""
    t = TrainConfig()
    assert t.keep_last == 3 and t.ckpt_every_minutes == 30.0
    out, res, s = reference
    with h5py.File(out / "checkpoints" / "ckpt-00000020.h5", "r") as f:
        meta = json.loads(f["meta_json"][...].tobytes())
    assert "losses" not in meta["run"] and meta["run"]["step"] == 20
    assert "steps" not in s and s["last_step"]["step"] == 20, "summary.json does not repeat every step row"


def test_final_report_prints_the_verified_and_the_newest_manifest_only(tmp_path):
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", 8, "--ckpt-every", 1, "--keep-last", 2, "--quiet")
    assert res.returncode == 0, res.stderr
    printed = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("checkpoint ")]
    assert [p.rsplit("/", 1)[1] for p in printed] == ["ckpt-00000001.h5", "ckpt-00000008.h5"]
    assert "8 checkpoints written, 3 kept" in res.stdout
    assert len(summary(out)["checkpoints"]) == 8


def test_corpus_too_short_to_exist_is_a_config_error(tmp_path):
    res = mpirun(3, "--out", tmp_path / "run", "--corpus-tokens", 1, timeout=60)
    assert res.returncode == 2 and res.stderr.count("corpus_tokens must be an integer >= 2") == 1
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()


def test_help_shows_defaults_and_keeps_test_hooks_apart():
    text = build_parser().format_help()
    assert "(default: 0.01)" in text and "(default: 'reference')" in text
    options = text[text.index("\noptions:"):]   # after the usage lines
    users, hooks = options.split("\ntest hooks", 1)
    assert "--inject-lr-spike" in hooks and "--stop-after" in hooks and "--inject-nan" in hooks
    assert "--inject" not in users and "--lr LR" in users and "--resume" in users
