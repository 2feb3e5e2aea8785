"""What --init-from makes of a damaged or wrong source: a damaged HF directory, an export whose tensor
data no longer matches the sha256 it recorded, non-finite weights, a directory that is no source, and
the advice of the refusals (tiny models written here; one 2-rank run of 2 steps for a checkpoint)."""

import dataclasses
import json
import os
import shutil
import types

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from conftest import mpirun
from test_finetune import run_module
from test_gpt2_hf import write_dir

from capstone import export
from capstone.gpt2 import tensors as gpt2_tensors

from capstone.gpt2 import finetune, hf
from capstone.checkpoint import CheckpointError
from capstone.config import ConfigError, ModelConfig
from capstone.model.params import Layout, init_params

CFG = ModelConfig(vocab_size=20, seq_len=8, d_model=16, n_heads=2, n_layers=1, head_bias=False)
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


def test_both_exports_record_a_tensor_digest_that_init_from_checks(run, tmp_path):
    """The digest is a string in the metadata (transformers reads it as any), over the tensors as stored;
    one flipped byte of tensor data is refused, with the advice to export again."""
    for source in (run / "x.safetensors", run / "hf" / "model.safetensors"):
        with safe_open(str(source), framework="numpy") as f:
            meta = f.metadata()
        assert meta[gpt2_tensors.DIGEST_KEY] == gpt2_tensors.tensor_digest(load_file(str(source)))
        assert all(isinstance(v, str) for v in meta.values())
    shutil.copy(run / "x.safetensors", tmp_path / "x.safetensors")
    shutil.copytree(run / "hf", tmp_path / "hf")
    for source in (tmp_path / "x.safetensors", tmp_path / "hf"):
        finetune.read(str(source))   # intact: accepted
        flip(source if source.is_file() else source / "model.safetensors")
        with pytest.raises(CheckpointError, match="does not match the sha256 its export recorded") as exc:
            finetune.read(str(source))
        assert f"--init-from {source}" in str(exc.value) and "Export the checkpoint again" in str(exc.value)


def test_non_finite_weights_are_refused_from_any_source(run, tmp_path):
    """A foreign HF model (no digest) and an export whose digest matches its NaN both name the tensor."""
    params = init_params(Layout.for_model(CFG, 1), CFG, 1)
    params[3] = np.nan   # in wte, the first tensor
    write_dir(tmp_path / "foreign", CFG, params)
    tensors = load_file(str(run / "x.safetensors"))
    with safe_open(str(run / "x.safetensors"), framework="numpy") as f:
        meta = f.metadata()
    tensors["transformer.h.0.mlp.c_fc.bias"][0] = np.inf
    save_file(tensors, str(tmp_path / "inf.safetensors"),
              metadata={**meta, gpt2_tensors.DIGEST_KEY: gpt2_tensors.tensor_digest(tensors)})
    for source, tensor in ((tmp_path / "foreign", "wte"), (tmp_path / "inf.safetensors", "h0.mlp.c_fc.b")):
        with pytest.raises(CheckpointError, match="1 of its weights are NaN or infinite") as exc:
            finetune.read(str(source))
        assert f"(in {tensor})" in str(exc.value) and "earlier checkpoint" in str(exc.value)


def test_a_directory_that_is_no_source_says_what_it_is_and_what_is_taken(run, tmp_path):
    shutil.copytree(run / "hf", tmp_path / "hf")
    os.remove(tmp_path / "hf" / "model.safetensors")
    shutil.copytree(tmp_path / "hf", tmp_path / "bin")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"a pickle")
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "meta.json").write_text("{}")
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    for source, words in (("hf", "config.json found but model.safetensors missing"),
                          ("dataset", "not a run directory, checkpoint, .safetensors export or Hugging Face model"),
                          ("fresh", "the run wrote no checkpoint yet"),
                          ("typo", "no such file or directory"), ("bin", r"pytorch_model.bin, a pickle.*save_pretrained"), ("typo.safetensors", "no such file or directory")):
        with pytest.raises(ConfigError, match=words) as exc:
            finetune.read(str(tmp_path / source))
        assert source == "fresh" or finetune.ACCEPTS in str(exc.value)      # was: a run directory or a ckpt-*.h5


def test_the_refusals_say_what_to_do(run, tmp_path):
    """No --data for a text model; a config.json whose n_layer was raised; a corrupt checkpoint (whose
    advice is fine-tuning's, not --resume auto's)."""
    text = finetune.Source("m.safetensors", "export", 0, CFG, {"tokenizer": {"kind": "char", "chars": "ab"}},
                           np.empty(0, np.float32))
    with pytest.raises(ConfigError, match="Pass --data with the dataset it was trained on"):
        finetune.check_vocabulary(text, {}, None)
    shutil.copytree(run / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "n_layer": 2}))
    with pytest.raises(ConfigError, match=r"lacks h1\..*Restore config.json to the model's own settings"):
        hf.read(str(tmp_path / "hf"))
    ckpt = os.path.realpath(os.path.join(run, "run", "checkpoints", "ckpt-00000002.h5"))
    shutil.copy(ckpt, tmp_path / "bad.h5")
    shutil.copy(ckpt + ".sha256", tmp_path / "bad.h5.sha256")
    flip(tmp_path / "bad.h5", os.path.getsize(ckpt) // 2)
    with pytest.raises(CheckpointError, match="pass another checkpoint of that run") as exc:
        finetune.read(str(tmp_path / "bad.h5"))
    assert "--resume" not in str(exc.value)


def test_a_model_flag_that_differs_is_named_as_typed():
    """A boolean model setting is named by its flag (was: `--tie-embeddings False (it has True)`)."""
    settings = types.SimpleNamespace(explicit={"tie_embeddings": False, "d_model": 16})
    source = finetune.Source("DIR", "export", 0, dataclasses.replace(CFG, tie_embeddings=True), {},
                             np.empty(0, np.float32))
    with pytest.raises(ConfigError, match=r"--no-tie-embeddings \(it has --tie-embeddings\)"):
        finetune.model_for(settings, source)
