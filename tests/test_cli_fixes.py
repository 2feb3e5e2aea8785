"""Small fixes of issue 28: `checkpoint verify --json`, `python -m capstone.train --help` from the directory that
holds a clone called capstone/, and a resume comparing only the data identity keys an older checkpoint has."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from conftest import ROOT, mpi_env, mpirun

from capstone.checkpoint import CheckpointError, _check_compatible
from capstone.config import ModelConfig
from capstone.model.params import Layout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "run"
    res = mpirun(2, "--out", out, "--steps", 2, "--ckpt-every", 2, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    return str(out)


def checkpoint_tool(*args):
    return subprocess.run([sys.executable, "-m", "capstone.checkpoint", *map(str, args)], capture_output=True,
                          text=True, env=mpi_env(), cwd=ROOT, timeout=120)


def test_verify_json_prints_one_json_object(run, tmp_path):
    res = checkpoint_tool("verify", run, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)                                   # stdout is the JSON object only
    assert report["verified"] is True and report["step"] == 2 and report["world_size"] == 2
    assert report["problems"] == [] and all(c["ok"] for c in report["checks"]) and len(report["checks"]) >= 5
    assert "verified" in res.stderr                                   # the human lines go to stderr
    missing = checkpoint_tool("verify", tmp_path / "nope", "--json")
    assert missing.returncode == 2 and json.loads(missing.stdout)["verified"] is False   # a usage mistake
    plain = checkpoint_tool("verify", run)
    assert plain.returncode == 0 and not plain.stdout.startswith("{")


def clone_in(tmp_path) -> str:
    """A copy of the working tree at TMP/capstone (the directory that holds it is TMP)."""
    dest = tmp_path / "capstone"

    def ignore(folder, names):                  # the top level's bulky folders; capstone/data is code
        return {".git", ".venv", ".venv-torch", "runs", "data"} & set(names) if folder == ROOT else {"__pycache__"} & set(names)
    shutil.copytree(ROOT, dest, ignore=ignore)
    return str(dest)


def test_train_help_from_the_directory_holding_the_clone(tmp_path):
    clone = clone_in(tmp_path)
    env = {k: v for k, v in mpi_env().items() if k != "PYTHONPATH"}
    # scripts/env.sh: PYTHONPATH names the clone, so its regular package wins over the namespace package ./capstone
    res = subprocess.run(["bash", "-c", "source capstone/scripts/env.sh && python -m capstone.train --help"],
                         capture_output=True, text=True, env={**env, "CAPSTONE_VENV": sys.prefix}, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("usage: python -m capstone.train"), res.stderr
    # the venv: scripts/setup writes capstone.pth, which names the clone (not pip's editable_mode=compat, whose
    # deprecation box ended the set-up's output, nor its other modes' import hook, which ./capstone shadows)
    with open(os.path.join(ROOT, "scripts", "setup")) as f:
        setup = f.read()
    assert '"$ROOT" >"$SITE/capstone.pth"' in setup and "editable_mode=compat -e \"$ROOT\"" not in setup
    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:             # this venv's libraries, not its capstone
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    def help_():
        return subprocess.run([str(venv / "bin" / "python"), "-m", "capstone.train", "--help"], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=120)
    before = help_()
    assert before.returncode != 0 and "capstone.train" in before.stderr   # ./capstone, a namespace package, shadows
    with open(os.path.join(site, "capstone.pth"), "w") as f:
        f.write(clone + "\n")                                         # what scripts/setup writes
    after = help_()
    assert after.returncode == 0 and after.stdout.startswith("usage: python -m capstone.train"), after.stderr


def test_resume_compares_only_the_data_keys_the_checkpoint_has():
    cfg = ModelConfig()
    layout = Layout.for_model(cfg, 2)
    old = {"format": "capstone-char-tokens", "version": 1, "vocab_size": 30, "chars_sha256": "a" * 64, "seed": 1}
    new = {**old, "digest": "d" * 64, "tokenizer": {"kind": "char", "chars": "x"}, "val_chars": 300}
    meta = {"model_config": {"vocab_size": 64}, "data": old, "layout": json.loads(layout.to_json())}
    _check_compatible(meta, "ckpt", layout, {"model_config": {"vocab_size": 64}, "data": new})     # no error
    with pytest.raises(CheckpointError, match="chars_sha256 is 'aaaa"):
        _check_compatible(meta, "ckpt", layout, {"model_config": {"vocab_size": 64},
                                                 "data": {**new, "chars_sha256": "b" * 64}})
    with pytest.raises(CheckpointError, match="n_layers is None in the checkpoint but 2"):   # models: every key
        _check_compatible(meta, "ckpt", layout, {"model_config": {"vocab_size": 64, "n_layers": 2}, "data": new})
    meta["data"] = new                                                # a new checkpoint: the new keys count
    with pytest.raises(CheckpointError, match="digest is 'dddd"):
        _check_compatible(meta, "ckpt", layout, {"model_config": {"vocab_size": 64}, "data": {**new, "digest": "e"}})
