"""capstone.sample: text from a checkpoint written by 3 ranks, seeded and reproducible, refusals of a
mismatched vocabulary and of a corrupted checkpoint, and the KV cache against the full forward."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, flip_shard_byte, mpi_env, mpirun, summary

from capstone import sample
from capstone.config import ModelConfig
from capstone.model.gpt import logits
from capstone.model.fingerprint import fingerprint
from capstone.model.params import Layout, init_params

TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
        "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\nDeny thy father and refuse thy name.\n\n") * 12
OTHER = "0123456789 +-*/=()\n" * 40        # another vocabulary


def prepare(tmp, name: str, text: str) -> str:
    src, out = tmp / f"{name}.txt", tmp / name
    src.write_text(text, encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "capstone.prepare", str(src), "--out", str(out)],
                         capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return str(out)


def train(out, *args):
    """4 steps on 3 ranks, checkpoints at steps 2 and 4 (the sampler needs those, not a passing invariant)."""
    return mpirun(3, "--out", out, "--steps", 4, "--ckpt-every", 2, "--eval-batch-size", 8, "--quiet", *args)


def trained(out, res) -> str:
    assert os.path.isfile(os.path.join(out, "checkpoints", "ckpt-00000004.h5")), res.stdout + res.stderr
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    return prepare(tmp, "romeo", TEXT), prepare(tmp, "digits", OTHER)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, data):
    """4 steps on 3 ranks of the prepared text (vocab_size from the data)."""
    out = str(tmp_path_factory.mktemp("text") / "run")
    res = train(out, "--data", data[0])
    if res.returncode != 0 and "--data" in res.stderr and "unrecognized" in res.stderr:
        pytest.skip("capstone.train has no --data flag in this tree yet")
    return trained(out, res)


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synthetic") / "run")
    return trained(out, train(out))


def cli(*args):
    """`python -m capstone.sample ARGS` as a plain process: no mpirun."""
    return subprocess.run([sys.executable, "-m", "capstone.sample", *map(str, args)], capture_output=True,
                          text=True, env=mpi_env(), cwd=ROOT, timeout=120)


def sample_main(capsys, *args):
    code = sample.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_is_seeded_and_reproducible(text_run, data, capsys):
    first = cli(text_run, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 1)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("ROMEO:") and len(first.stdout) == len("ROMEO:") + 60 + 1   # + print's newline
    assert set(first.stdout[:-1]) <= set(TEXT) and "3 ranks" in first.stderr
    code, again, _ = sample_main(capsys, text_run, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 1)
    assert code == 0 and again == first.stdout
    code, other, _ = sample_main(capsys, text_run, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 2)
    assert code == 0 and other != first.stdout
    ckpt = os.path.join(text_run, "checkpoints", "ckpt-00000004.h5")
    code, direct, _ = sample_main(capsys, ckpt, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 1, "--data", data[0])
    assert code == 0 and direct == first.stdout                  # RUN_DIR = its latest checkpoint


def test_mismatched_vocabulary_is_refused(text_run, data, capsys):
    code, out, err = sample_main(capsys, text_run, "--data", data[1], "--tokens", 5)
    assert code == 2 and out == ""
    assert "vocabulary mismatch" in err and "--data" in err and "Traceback" not in err


def test_reassembles_the_three_rank_parameters(synthetic_run):
    meta, cfg, params = sample.load_checkpoint(os.path.join(synthetic_run, "checkpoints", "ckpt-00000004.h5"))
    assert meta["world_size"] == 3 and cfg == ModelConfig(**summary(synthetic_run)["model_config"])
    padded = np.zeros(Layout.for_model(cfg, 3).padded, np.float32)
    padded[:params.size] = params                                # ZeRO padding is zero
    assert list(fingerprint(padded)) == summary(synthetic_run)["final_param_fingerprint"]


def test_synthetic_checkpoint_samples_ids(synthetic_run, data, capsys):
    res = cli(synthetic_run, "--prompt-ids", "1 2 3", "--tokens", 20, "--seed", 5)
    assert res.returncode == 0, res.stderr
    ids = [int(t) for t in res.stdout.split()]
    assert ids[:3] == [1, 2, 3] and len(ids) == 23 and all(0 <= t < 64 for t in ids)
    assert "synthetic" in res.stderr
    code, _, err = sample_main(capsys, synthetic_run, "--prompt", "ROMEO:")
    assert code == 2 and "--prompt-ids" in err
    code, _, err = sample_main(capsys, synthetic_run, "--data", data[0])
    assert code == 2 and "synthetic corpus" in err


def test_corrupted_checkpoint_is_refused_like_verify(synthetic_run, tmp_path):
    bad = tmp_path / "ckpt-00000004.h5"
    shutil.copy(os.path.join(synthetic_run, "checkpoints", "ckpt-00000004.h5"), bad)
    shutil.copy(os.path.join(synthetic_run, "checkpoints", "ckpt-00000004.h5.sha256"), str(bad) + ".sha256")
    flip_shard_byte(bad, 1, 4 * 123, 0x40)
    res = cli(bad, "--prompt-ids", "1", "--tokens", 5)
    verify = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", str(bad)], capture_output=True,
                            text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert verify.returncode == 1 and res.returncode == 1 and res.stdout == ""
    assert res.stderr.count("not a valid checkpoint") == 1 and "sha256" in res.stderr
    assert "Traceback" not in res.stderr


def random_model(seed=0):
    cfg = ModelConfig(vocab_size=13, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    layout = Layout.for_model(cfg, 1)
    flat = init_params(layout, cfg, seed)
    flat += np.random.default_rng(seed).normal(0, 0.1, flat.shape).astype(np.float32)  # non-trivial LN and biases
    return cfg, layout, flat


def test_kv_cache_equals_full_forward():
    cfg, layout, flat = random_model()
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, cfg.seq_len)
    want = logits(layout.groups(flat), ids[None].astype(np.int32), cfg)               # (T, V)
    kv = sample.KVCache(layout.views(flat), cfg)
    got = np.concatenate([kv.forward(ids[:5])] + [kv.forward(ids[t:t + 1]) for t in range(5, cfg.seq_len)])
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-5
    with pytest.raises(ValueError, match="seq_len"):
        kv.forward(ids[:1])
    kv.reset()
    assert np.abs(kv.forward(ids, last=True) - want[-1:]).max() < 1e-5                 # the top block's last row
    # past seq_len the context is cropped, as nanoGPT does: both paths pick the same tokens
    args = (flat, cfg, [1, 2, 3], 3 * cfg.seq_len, 1.0, 0, 7)
    assert sample.generate(*args, cache=True) == sample.generate(*args, cache=False)


def test_pick_temperature_and_top_k():
    z = np.array([0.0, 3.0, 1.0, 2.9, -1.0], np.float32)
    rng = np.random.default_rng(0)
    assert sample.pick(z, 0.0, 0, rng) == 1 and sample.pick(z, 5.0, 1, rng) == 1
    assert {sample.pick(z, 10.0, 2, rng) for _ in range(200)} == {1, 3}
    assert {sample.pick(z, 10.0, 0, rng) for _ in range(200)} == set(range(5))
