"""A run directory holds one run (issue 34): its id in the lock, the metrics and the checkpoints; another
run's checkpoint is not resumed into it; `--resume RUN_DIR` without --out continues in RUN_DIR. And what a
start says about settings it did not take as given: a preset's warmup shortened to fit a short run."""

import json
import subprocess
import sys

from conftest import mpi_env, mpirun

from capstone.checkpoint import read_meta_file

TINY = ["--steps", 2, "--ckpt-every", 2, "--quiet"]


def train_in(cwd, *args):
    """`python -m capstone.train ARGS` on 1 rank from directory `cwd` (where a default runs/ would go)."""
    cmd = ["mpirun", "-n", "1", "--oversubscribe", sys.executable, "-m", "capstone.train", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=mpi_env(), cwd=cwd)


def run_ids(out) -> dict:
    """The run id as the lock, each start row of metrics.jsonl and each checkpoint record it."""
    starts = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"start"' in line]
    ckpts = {path.name: read_meta_file(str(path))["run"]["run_id"] for path in (out / "checkpoints").glob("ckpt-*.h5")}
    return {"lock": json.loads((out / ".lock").read_text())["run_id"], "starts": [r["run_id"] for r in starts],
            "checkpoints": ckpts}


def contents(out) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_another_runs_checkpoint_is_not_resumed_into_an_occupied_out(tmp_path):
    """The issue's `--out runs/rs --resume runs/shk/checkpoints/ckpt-...` where runs/rs holds another model:
    refused with the reason (exit 2), runs/rs unchanged."""
    shk, rs = tmp_path / "shk", tmp_path / "rs"
    assert mpirun(1, "--out", shk, *TINY).returncode == 0
    assert mpirun(1, "--out", rs, "--d-model", 64, *TINY).returncode == 0
    ids, before = run_ids(shk), contents(rs)
    mine = ids["lock"]
    assert ids == {"lock": mine, "starts": [mine], "checkpoints": {"ckpt-00000002.h5": mine}}, ids
    theirs = run_ids(rs)["lock"]
    assert theirs != mine
    res = mpirun(1, "--out", rs, "--resume", shk / "checkpoints" / "ckpt-00000002.h5", "--steps", 4)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stdout + res.stderr
    assert f"belongs to run {mine}" in errors[0] and f"metrics.jsonl of run {theirs}" in errors[0], errors
    assert "--resume latest" in errors[0] and "Traceback" not in res.stderr
    assert contents(rs) == before, "a refused resume changes nothing"


def test_resume_of_a_run_directory_continues_there(tmp_path):
    """`--resume RUN_DIR` (or a checkpoint in it) without --out continues in RUN_DIR, under the same run id;
    no runs/run-<time> is made."""
    assert train_in(tmp_path, "--out", "shk", *TINY).returncode == 0
    res = train_in(tmp_path, "--resume", "shk", "--steps", 3)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "continuing in shk, the run directory of --resume shk" in res.stdout
    res = train_in(tmp_path, "--resume", "shk/checkpoints/ckpt-00000003.h5", "--steps", 4, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (tmp_path / "runs").exists(), "no new run directory"
    names = sorted(p.name for p in (tmp_path / "shk" / "checkpoints").glob("ckpt-*.h5"))
    assert names == ["ckpt-00000002.h5", "ckpt-00000003.h5", "ckpt-00000004.h5"], names
    ids = run_ids(tmp_path / "shk")
    assert len(ids["starts"]) == 3 and {ids["lock"], *ids["starts"], *ids["checkpoints"].values()} == {ids["lock"]}


def test_a_presets_warmup_is_shortened_to_fit_a_short_run(tmp_path):
    """`--preset medium --steps 2` (warmup 40) runs, saying its warmup is 1 step (here with a small model);
    an explicit --warmup-steps longer than the run is still refused."""
    small = ["--d-model", 32, "--n-heads", 4, "--seq-len", 16, "--batch-size", 2, "--eval-batch-size", 4]
    res = mpirun(1, "--out", tmp_path / "m", "--preset", "medium", "--steps", 2, *small)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "the warmup of --preset medium (40 of its 400 steps) is shortened to 1 for --steps 2" in res.stdout
    assert json.loads((tmp_path / "m" / "summary.json").read_text())["train_config"]["warmup_steps"] == 1
    res = mpirun(1, "--out", tmp_path / "w", "--preset", "medium", "--steps", 2, "--warmup-steps", 3, *small)
    assert res.returncode == 2 and "--warmup-steps 3 is longer than steps 2" in res.stderr, res.stderr
    assert not (tmp_path / "w").exists()
