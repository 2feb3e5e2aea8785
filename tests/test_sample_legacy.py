"""capstone.sample on a checkpoint written before checkpoints carried their tokenizer: it samples with its dataset
(found from the run's --data path, or given), refuses another one, and resumes under the current code."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import mpi_env, mpirun
from test_prepare import v1_meta
from test_sample import SAME_SIZE, TEXT, cli, prepare, sample_main, trained

from capstone import sample


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    return {"romeo": prepare(tmp, "romeo", TEXT), "same-size": prepare(tmp, "same-size", SAME_SIZE)}


LEGACY = '''
import runpy, sys
import capstone.data.tokens as t

def identity(self):
    """TokenData.identity() before checkpoints carried the tokenizer."""
    m = self.meta
    return {"format": "capstone-char-tokens", "version": 1, "vocab_size": m.vocab_size,
            "chars_sha256": m.tokenizer.sha256, "train_tokens": m.train.tokens, "train_sha256": m.train.sha256,
            "val_tokens": m.val.tokens, "val_sha256": m.val.sha256}

t.TokenData.identity = identity
sys.argv = ["capstone.train", *sys.argv[1:]]
runpy.run_module("capstone.train", run_name="__main__")
'''


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory, data):
    """A run whose checkpoints record the data identity as before this change, on a dataset whose meta.json is
    version 1 too; its --data path is relative to the working directory of the run."""
    tmp = tmp_path_factory.mktemp("legacy")
    shutil.copytree(data["romeo"], tmp / "data")
    v1_meta(tmp / "data")
    (tmp / "legacy_train.py").write_text(LEGACY)
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(tmp / "legacy_train.py"), "--out", "run",
           "--data", "data", "--steps", 4, "--ckpt-every", 2, "--eval-batch-size", 8, "--quiet"]
    res = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=mpi_env(), cwd=tmp, timeout=180)
    return trained(str(tmp / "run"), res)


def test_a_checkpoint_from_before_samples_with_its_dataset_and_resumes(legacy_run, data, capsys):
    meta, _, _ = sample.load_checkpoint(os.path.join(legacy_run, "checkpoints", "ckpt-00000004.h5"))
    assert "tokenizer" not in meta["data"] and "chars_sha256" in meta["data"]
    res = cli(legacy_run, "--prompt", "ROMEO:", "--tokens", 20, cwd="/")   # finds ../data from the run directory
    assert res.returncode == 0 and res.stdout.startswith("ROMEO:") and "char vocabulary of" in res.stderr, res.stderr
    code, out, _ = sample_main(capsys, legacy_run, "--prompt", "ROMEO:", "--tokens", 20, "--data", data["romeo"])
    assert code == 0 and out == res.stdout                         # the same dataset, prepared since (version 2)
    code, _, err = sample_main(capsys, legacy_run, "--data", data["same-size"], "--tokens", 5)
    assert code == 2 and "vocabulary has 36 characters" in err and "sha256" in err
    resumed = mpirun(2, "--out", legacy_run, "--resume", "latest", "--steps", 6, "--data",
                     os.path.join(os.path.dirname(legacy_run), "data"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    meta, _, _ = sample.load_checkpoint(os.path.join(legacy_run, "checkpoints", "ckpt-00000006.h5"))
    assert meta["data"]["tokenizer"]["kind"] == "char"            # its new checkpoints carry the vocabulary
