"""What --init-from makes of a damaged or wrong source: a damaged HF directory, an export whose tensor
data no longer matches the sha256 it recorded, non-finite weights, a directory that is no source, and
the advice of the refusals (tiny models written here; one 2-rank run of 2 steps for a checkpoint)."""

import os
import shutil

import pytest

from conftest import mpirun
from test_finetune import run_module

MODEL = ["--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--seq-len", "8", "--no-head-bias"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run on the synthetic corpus, its .safetensors export and its --format hf export."""
    tmp = tmp_path_factory.mktemp("sources")
    res = mpirun(2, "--out", tmp / "run", *MODEL, "--steps", 2, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    for out, fmt in ((tmp / "x.safetensors", []), (tmp / "hf", ["--format", "hf"])):
        res = run_module("capstone.export", tmp / "run", "--out", out, *fmt)
        assert res.returncode == 0, res.stdout + res.stderr
    return tmp


def flip(path, at=-100):
    data = bytearray(open(path, "rb").read())
    data[at] ^= 1
    open(path, "wb").write(bytes(data))


def refused(res) -> str:
    """The one error line of a refused start."""
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in res.stderr and "MPI_ABORT" not in res.stderr, res.stderr
    return errors[0]


@pytest.mark.parametrize("damage", ["truncated", "header not JSON"])
def test_a_damaged_hf_directory_is_refused_cleanly_on_every_rank(run, tmp_path, damage):
    """Like a damaged .safetensors export: one error naming --init-from, exit 1, no --out left behind."""
    shutil.copytree(run / "hf", tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    if damage == "truncated":
        os.truncate(weights, 5000)
    else:
        data = bytearray(weights.read_bytes())
        data[8] = ord("#")   # the header's first byte, its opening brace
        weights.write_bytes(bytes(data))
    res = mpirun(2, "--out", tmp_path / "ft", "--init-from", tmp_path / "hf", "--steps", 1, "--quiet")
    error = refused(res)
    assert res.returncode == 1 and "unreadable model.safetensors" in error and "export the checkpoint again" in error
    assert not (tmp_path / "ft").exists(), "a refused start leaves nothing behind"

