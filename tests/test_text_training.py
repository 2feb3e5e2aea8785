"""Training on prepared text (`--data`) under mpirun, and the presets."""

import subprocess
import sys

import pytest

from capstone.cli import parse
from capstone.flags.presets import PRESETS

from conftest import ROOT, by_step, mpi_env, mpirun, step_rows, summary

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 40
SMALL = ["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--global-batch", "12",
         "--eval-batches", "2", "--eval-batch-size", "6", "--lr", "3e-3", "--ckpt-every", "3"]


def prepare(tmp, text, name="data"):
    src, out = tmp / f"{name}.txt", tmp / name
    src.write_text(text, encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "capstone.prepare", str(src), "--out", str(out)],
                         capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("text"), TEXT)


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("two") / "run"
    res = mpirun(2, "--out", out, "--data", data, "--steps", 6, *SMALL)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


@pytest.mark.parametrize("n", [1, 3])
def test_text_run_is_the_same_on_any_number_of_ranks(data, two_ranks, tmp_path, n):
    """--global-batch 12: 1, 2 and 3 ranks see the same samples and give the same losses."""
    out = tmp_path / "run"
    res = mpirun(n, "--out", out, "--data", data, "--steps", 6, *SMALL)
    assert res.returncode == 0, res.stdout + res.stderr
    s = summary(out)
    assert s["model_config"]["vocab_size"] == len(set(TEXT)), "the vocabulary comes from the data"
    assert all(v["ok"] for v in s["invariants"].values())
    got, want = by_step(out), by_step(two_ranks)
    assert sorted(got) == list(range(1, 7))
    for step in got:
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-5), step
    assert step_rows(out, "samples") == step_rows(two_ranks, "samples")


def test_text_run_resumes_bit_identically(data, two_ranks, tmp_path):
    out = tmp_path / "run"
    assert mpirun(2, "--out", out, "--data", data, "--steps", 6, "--stop-after", 3, *SMALL).returncode == 0
    res = mpirun(2, "--out", out, "--resume", "latest")  # the settings come from the checkpoint
    assert res.returncode == 0, res.stdout + res.stderr
    assert by_step(out) == by_step(two_ranks)
    assert summary(out)["final_param_fingerprint"] == summary(two_ranks)["final_param_fingerprint"]


def test_resume_with_changed_data_is_refused_naming_data(data, two_ranks, tmp_path):
    """Other data on --resume is a usage mistake named by --data (it was blamed on the model flags, or on a
    --vocab-size never given when the vocabularies differed); a moved copy of the same data resumes."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(two_ranks, out)
    for name, text in (("other", TEXT.replace("speak", "spake")), ("wider", TEXT + "xyz QZ")):
        res = mpirun(2, "--out", out, "--resume", "latest", "--data", prepare(tmp_path, text, name), "--steps", 9)
        assert res.returncode == 2 and res.stderr.count("error:") == 1, res.stdout + res.stderr
        assert f"--data {tmp_path / name} is not the data" in res.stderr and f"--data {data}" in res.stderr, res.stderr
        assert "--vocab-size" not in res.stderr and "model flags" not in res.stderr, res.stderr
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    res = mpirun(2, "--out", out, "--resume", "latest", "--data", moved, "--steps", 7)
    assert res.returncode == 0 and summary(out)["final_step"] == 7, res.stdout + res.stderr


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_a_valid_config(name):
    s = parse(["--preset", name])
    for key, value in PRESETS[name].items():
        assert getattr(s.model, key, getattr(s.train, key, None)) == value, key


def test_an_explicit_flag_overrides_the_preset():
    s = parse(["--preset", "shakespeare-char", "--lr", "5e-4", "--n-layers", "2"])
    assert s.train.lr == 5e-4 and s.model.n_layers == 2 and s.model.d_model == 128
    assert s.explicit["lr"] == 5e-4
