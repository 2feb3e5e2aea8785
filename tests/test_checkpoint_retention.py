"""When checkpoints are written and which are kept: the wall-clock interval, --keep-last with the
checkpoint invariant (d) reloads, the defaults of long runs, the short final report, and
`python -m capstone.checkpoint inspect`."""

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from capstone.checkpoint import files, integrity
from capstone.config import TrainConfig

from conftest import ROOT, flip_shard_byte, mpi_env, mpirun, step_rows, summary


def test_wall_clock_checkpoints_are_spaced_by_the_interval(tmp_path):
    """--ckpt-every-minutes 0.01 (0.6 s) with steps of about 0.25 s: at least two saves before the
    last step, and consecutive ones at least 0.6 s apart by their step rows' times, when each save
    was taken (catches: minutes taken as seconds, a clock never reset, a save every step). Not by
    the files' times: a background write ends when it ends, so two files can be closer than that."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", "10", "--ckpt-every", "0", "--ckpt-every-minutes", "0.01",
                 "--sleep-per-step", "0.25", "--keep-last", "0")   # every file kept: its time is read below
    assert res.returncode == 0, res.stderr
    saved = [c["step"] for c in summary(out)["checkpoints"]]
    clock = [s for s in saved if s != 10]
    assert saved[-1] == 10 and len(clock) >= 2, saved
    taken = {r["step"]: r["time"] for r in step_rows(out)}
    times = [taken[s] for s in clock]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.55, (saved, gaps)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """2 ranks, 6 steps, a checkpoint every step, --keep-last 2."""
    out = tmp_path_factory.mktemp("kept") / "run"
    res = mpirun(2, "--out", out, "--steps", "6", "--ckpt-every", "1", "--keep-last", "2")
    assert res.returncode == 0, res.stderr
    return out


def test_keep_last_keeps_the_newest_and_the_one_to_verify(kept):
    """--keep-last 2 end to end: the newest two remain, and the run's first checkpoint survives
    until invariant (d) has reloaded it at the end (catches: the first checkpoint not protected,
    retention deleting the newest)."""
    names = sorted(n for n in os.listdir(kept / "checkpoints") if not n.endswith(".sha256"))
    assert names == [files.final_name(1), files.final_name(5), files.final_name(6), "latest"], names
    s = summary(kept)
    assert s["invariants"]["d_resume_bytes"]["ok"] and s["invariants"]["d_resume_bytes"]["path"].endswith(files.final_name(1))
    removed = [r for c in s["checkpoints"] for r in c["removed"]]
    assert sorted(removed) == [files.final_name(s) for s in (2, 3, 4)]


def checkpoint_tool(*args):
    return subprocess.run([sys.executable, "-m", "capstone.checkpoint", *map(str, args)],
                          capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=60)


def test_checkpoint_inspect(kept, tmp_path):
    """`python -m capstone.checkpoint inspect`: the manifest and exit 0; --json the metadata; a
    damaged shard prints only the failed check and exits 1; not a checkpoint exits 1 (catches:
    inspect that prints but does not verify)."""
    path = kept / "checkpoints" / files.final_name(6)
    res = checkpoint_tool("inspect", path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step 6, 2 ranks" in res.stdout and "data cursor 48" in res.stdout and "Adam step 6" in res.stdout
    assert "/shards/rank00000" in res.stdout and "/shards/rank00001" in res.stdout
    assert all(f"logical {row}" in res.stdout for row in ("master", "m", "v"))
    assert res.stdout.rstrip().endswith("verified") and "BAD" not in res.stdout
    meta, _ = json.JSONDecoder().raw_decode(checkpoint_tool("inspect", path, "--json").stdout)
    assert meta["step"] == 6 and meta["run"]["data_cursor"] == 48 and meta["world_size"] == 2
    damaged = tmp_path / "damaged.h5"
    shutil.copy(path, damaged)
    flip_shard_byte(damaged, 1, 40, 0x10)
    res = checkpoint_tool("inspect", damaged)  # no digest file beside the copy: refused before parsing
    assert res.returncode == 1 and "not a valid checkpoint" in res.stderr and "BAD" not in res.stdout
    integrity.write_digest(str(damaged))  # as if damaged before it was hashed: the shard's digest catches it
    res = checkpoint_tool("inspect", damaged)
    assert res.returncode == 1 and "BAD /shards/rank00001" in res.stdout and "FAILED verification" in res.stdout
    assert "ok  /shards/rank00000" not in res.stdout, "inspect prints only the failed checks"
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    res = checkpoint_tool("inspect", other)
    assert res.returncode == 1 and "not a valid checkpoint" in res.stderr


def test_long_run_defaults_keep_few_checkpoints_without_history(reference):
    """Keep the last 3 (and the run's first), a wall-clock interval, no loss history inside."""
    t = TrainConfig()
    assert t.keep_last == 3 and t.ckpt_every_minutes == 30.0
    out, res, s = reference
    with h5py.File(out / "checkpoints" / "ckpt-00000020.h5", "r") as f:
        meta = json.loads(f["meta_json"][...].tobytes())
    assert "losses" not in meta["run"] and meta["run"]["step"] == 20
    assert "steps" not in s and s["last_step"]["step"] == 20, "summary.json does not repeat every step row"


def test_final_report_names_the_checkpoints_in_one_line(tmp_path):
    """The console's report names the checkpoints in one line (their digests are in summary.json, not 26
    lines of the console)."""
    out = tmp_path / "run"
    res = mpirun(2, "--out", out, "--steps", 8, "--ckpt-every", 1, "--keep-last", 2)
    assert res.returncode == 0, res.stderr
    lines = [line for line in res.stdout.splitlines() if line.startswith("checkpoint")]
    assert lines == [f"checkpoints: 8 written, 3 kept; ckpt-00000001.h5 reloaded by (d), newest "
                     f"{out}/checkpoints/ckpt-00000008.h5 (digests in summary.json; `python -m capstone.checkpoint "
                     f"inspect FILE` shows one)"], lines
    assert "sha256" not in res.stdout and len(res.stdout.splitlines()) < 8 + 40
    assert len(summary(out)["checkpoints"]) == 8 and all(m["meta_sha256"] for m in summary(out)["checkpoints"])
