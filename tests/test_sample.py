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
SAME_SIZE = TEXT.replace("?", "%")           # as many characters, one of them different
SAME_CHARS = TEXT.replace("light", "lihgt")  # the same characters, another text


def prepare(tmp, name: str, text: str, *extra) -> str:
    src, out = tmp / f"{name}.txt", tmp / name
    src.write_text(text, encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "capstone.prepare", str(src), "--out", str(out), *extra],
                         capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return str(out)


def train(out, *args, n=3):
    """4 steps on n ranks, checkpoints at steps 2 and 4 (the sampler needs those, not a passing invariant)."""
    return mpirun(n, "--out", out, "--steps", 4, "--ckpt-every", 2, "--eval-batch-size", 8, "--quiet", *args)


def trained(out, res) -> str:
    assert os.path.isfile(os.path.join(out, "checkpoints", "ckpt-00000004.h5")), res.stdout + res.stderr
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    return {"romeo": prepare(tmp, "romeo", TEXT), "digits": prepare(tmp, "digits", OTHER),
            "same-size": prepare(tmp, "same-size", SAME_SIZE), "same-chars": prepare(tmp, "same-chars", SAME_CHARS),
            "bpe": prepare(tmp, "bpe", TEXT, "--tokenizer", "bpe", "--vocab-size", "300")}


def train_then_delete_data(tmp_path_factory, name: str, source: str, *args) -> str:
    """A run trained on a copy of `source` that is deleted afterwards: the checkpoint must stand alone."""
    tmp = tmp_path_factory.mktemp(name)
    copy = str(tmp / "data")
    shutil.copytree(source, copy)
    out = str(tmp / "run")
    trained(out, train(out, "--data", copy, *args))
    shutil.rmtree(copy)
    return out


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, data):
    """4 steps on 3 ranks of the prepared text (vocab_size from the data), whose dataset is gone since."""
    return train_then_delete_data(tmp_path_factory, "text", data["romeo"])


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, data):
    return train_then_delete_data(tmp_path_factory, "bpe", data["bpe"], "--seq-len", 8)


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory, data):
    """--vocab-size 64, above the data's 36 characters: ids 36..63 exist in the model only."""
    return train_then_delete_data(tmp_path_factory, "wide", data["romeo"], "--vocab-size", 64)


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synthetic") / "run")
    return trained(out, train(out))


def cli(*args, cwd=ROOT):
    """`python -m capstone.sample ARGS` as a plain process: no mpirun."""
    return subprocess.run([sys.executable, "-m", "capstone.sample", *map(str, args)], capture_output=True,
                          text=True, env=mpi_env(), cwd=cwd, timeout=120)


def sample_main(capsys, *args):
    code = sample.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_is_seeded_and_reproducible(text_run, data, capsys):
    first = cli(text_run, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 1)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("ROMEO:") and len(first.stdout) == len("ROMEO:") + 60 + 1   # + print's newline
    assert set(first.stdout[:-1]) <= set(TEXT) and "3 ranks" in first.stderr
    assert "the checkpoint's own char vocabulary" in first.stderr       # its dataset was deleted after training
    code, again, _ = sample_main(capsys, text_run, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 1)
    assert code == 0 and again == first.stdout
    code, other, _ = sample_main(capsys, text_run, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 2)
    assert code == 0 and other != first.stdout
    ckpt = os.path.join(text_run, "checkpoints", "ckpt-00000004.h5")
    code, direct, _ = sample_main(capsys, ckpt, "--prompt", "ROMEO:", "--tokens", 60, "--seed", 1, "--data",
                                  data["romeo"])
    assert code == 0 and direct == first.stdout                  # RUN_DIR = its latest checkpoint; an equal dataset


@pytest.mark.parametrize("other, words", [
    ("digits", ["vocabulary has 36 characters, the dataset's 19", "only the checkpoint's has", "only the dataset's has"]),
    ("same-size", ["vocabulary has 36 characters, the dataset's 36", "only the checkpoint's has '?'",
                   "only the dataset's has '%'"]),
    ("same-chars", ["train.bin (the text)"]),
    ("bpe", ["tokenizer is char, the dataset's is bpe"]),
])
def test_a_different_dataset_is_refused_naming_what_differs(text_run, data, capsys, other, words):
    code, out, err = sample_main(capsys, text_run, "--data", data[other], "--tokens", 5)
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"{data[other]} is not the dataset" in err and "--data" in err and err.count("\n") == 1
    for word in words:
        assert word in err, (word, err)


def test_a_bpe_checkpoint_decodes_with_its_own_tokenizer(bpe_run, data, capsys):
    res = cli(bpe_run, "--prompt", "ROMEO: é😀", "--tokens", 40, "--seed", 3)   # bytes: any text encodes
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ROMEO: é😀") and "own bpe vocabulary (300 tokens)" in res.stderr
    code, again, _ = sample_main(capsys, bpe_run, "--prompt", "ROMEO: é😀", "--tokens", 40, "--seed", 3,
                                 "--data", data["bpe"])
    assert code == 0 and again == res.stdout
    code, _, err = sample_main(capsys, bpe_run, "--data", data["romeo"], "--tokens", 5)
    assert code == 2 and "tokenizer is bpe, the dataset's is char" in err


def test_a_model_vocabulary_larger_than_the_data_still_samples(wide_run, capsys):
    """Ids the dataset has no character for are never drawn (the old sampler refused: "has 36 ... trained on 36")."""
    code, out, err = sample_main(capsys, wide_run, "--tokens", 300, "--temperature", 20, "--top-k", 0)
    assert code == 0, err
    assert set(out[:-1]) <= set(TEXT) and len(out) == 1 + 300 + 1
    code, _, err = sample_main(capsys, wide_run, "--top-k", 37, "--tokens", 3)
    assert code == 2 and "--top-k 37 is larger than the vocabulary (36 tokens)" in err


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
    code, _, err = sample_main(capsys, synthetic_run, "--data", data["romeo"])
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


def test_pick_top_p_keeps_the_nucleus():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    rng = np.random.default_rng(0)
    assert {sample.pick(z, 1.0, 0, rng, top_p=0.75) for _ in range(300)} == {0, 1}      # 0.5 < 0.75 <= 0.8
    assert {sample.pick(z, 1.0, 0, rng, top_p=0.5) for _ in range(100)} == {0}          # the crossing id stays in
    assert {sample.pick(z, 1.0, 0, rng, top_p=0.96) for _ in range(600)} == {0, 1, 2, 3}
    assert {sample.pick(z, 1.0, 2, rng, top_p=1.0) for _ in range(300)} == {0, 1}       # top-k first


def test_greedy_decoding_is_the_argmax_of_the_logits():
    """temperature 0, and top-k 1 at any temperature, pick at each position the argmax of
    capstone.model.gpt.logits over the (cropped) context, computed here independently of the KV cache."""
    cfg, layout, flat = random_model(3)
    prompt, n = [1, 2, 3], 2 * cfg.seq_len + 5                     # well past the window: cropping too
    for temperature, top_k in ((0.0, 40), (0.8, 1)):
        for cache in (True, False):
            seq = prompt + sample.generate(flat, cfg, prompt, n, temperature, top_k, seed=9, cache=cache)
            for i in range(len(prompt), len(seq)):
                context = np.array([seq[:i][-cfg.seq_len:]], dtype=np.int32)
                assert seq[i] == int(np.argmax(logits(layout.groups(flat), context, cfg)[-1])), (temperature, i)


def test_ids_beyond_the_limit_are_never_drawn():
    cfg, layout, flat = random_model(4)
    layout.views(flat)["lm_head.b"][10:] = 50.0                    # the model prefers ids 10..12 by far
    free = sample.generate(flat, cfg, [0], 40, 1.0, 0, seed=1)
    assert min(free) >= 10
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (1.0, 0, 1.0), (2.0, 5, 0.9)):
        ids = sample.generate(flat, cfg, [0], 40, temperature, top_k, seed=1, top_p=top_p, limit=10)
        assert max(ids) < 10, (temperature, top_k, top_p)


BAD_ARGS = {
    "temperature nan": (["--temperature", "nan"], "--temperature nan"),
    "temperature inf": (["--temperature", "inf"], "finite"),
    "temperature negative": (["--temperature", "-0.5"], "--temperature -0.5"),
    "seed negative": (["--seed", "-1"], "--seed -1"),
    "tokens zero": (["--tokens", "0"], "--tokens 0"),
    "tokens negative": (["--tokens", "-5"], "--tokens -5"),
    "top-k negative": (["--top-k", "-1"], "--top-k -1"),
    "top-k too large": (["--top-k", "1000"], "larger than the vocabulary"),
    "top-p zero": (["--top-p", "0"], "--top-p 0.0"),
    "top-p above 1": (["--top-p", "1.5"], "(0, 1]"),
    "top-p nan": (["--top-p", "nan"], "--top-p nan"),
    "num-samples zero": (["--num-samples", "0"], "--num-samples 0"),
    "prompt-file missing": (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file /nonexistent/p.txt"),
    "prompt empty": (["--prompt", ""], "the prompt is empty"),
    "prompt outside the vocabulary": (["--prompt", "XYZ"], "'X' (U+0058) is not in the vocabulary"),
    "prompt ids out of range": (["--prompt-ids", "1 99"], "each in [0, 36)"),
    "prompt ids not numbers": (["--prompt-ids", "a b"], "expected integers"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_arguments_are_one_clear_paragraph(text_run, capsys, case):
    args, words = BAD_ARGS[case]
    code, out, err = sample_main(capsys, text_run, "--tokens", 5, *args)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert words in err and "Traceback" not in err


def test_bad_arguments_on_the_command_line(text_run, tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    for args, words in ((["--temperature", "nan"], "finite number"), (["--seed", "-1"], "integer >= 0"),
                        (["--prompt-file", tmp_path / "latin1.txt"], "not UTF-8"), (["--tokens", "x"], "invalid int")):
        res = cli(text_run, *args)
        assert res.returncode == 2 and res.stdout == "" and words in res.stderr and "Traceback" not in res.stderr


def test_num_samples_and_prompt_file(text_run, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("JULIET:", encoding="utf-8")
    code, out, _ = sample_main(capsys, text_run, "--prompt-file", tmp_path / "p.txt", "--tokens", 30, "--seed", 4,
                               "--num-samples", 3, "--top-p", 0.9)
    texts = out[:-1].split("\n---------------\n")
    assert code == 0 and len(texts) == 3 and all(t.startswith("JULIET:") and len(t) == 37 for t in texts)
    code, single, _ = sample_main(capsys, text_run, "--prompt", "JULIET:", "--tokens", 30, "--seed", 5, "--top-p", 0.9)
    assert code == 0 and single[:-1] == texts[1]                   # sample i uses seed SEED+i


def test_tokens_are_printed_as_they_are_made(text_run, capsys, monkeypatch):
    """Item 9: each token's text reaches stdout (flushed) while the next is still to be made, not all at the end."""
    increments, real = [], sample.generate

    def spy(*args, on_token, **kw):
        def hook(seq):
            on_token(seq)
            increments.append(capsys.readouterr().out)
        return real(*args, on_token=hook, **kw)
    monkeypatch.setattr(sample, "generate", spy)
    assert sample.main([text_run, "--prompt", "ROMEO:", "--tokens", "25", "--seed", "1"]) == 0
    assert len(increments) == 25 and increments[0].startswith("ROMEO:") and len(increments[0]) == len("ROMEO:") + 1
    assert all(len(piece) == 1 for piece in increments[1:]) and capsys.readouterr().out == "\n"
    monkeypatch.undo()
    code, whole, _ = sample_main(capsys, text_run, "--prompt", "ROMEO:", "--tokens", 25, "--seed", 1)
    assert code == 0 and whole == "".join(increments) + "\n"


def test_a_prompt_longer_than_the_context_is_said_to_be_cropped(text_run, bpe_run, capsys):
    long = "ROMEO: It is the east, and Juliet is the sun."                     # 45 characters; seq_len 16
    code, out, err = sample_main(capsys, text_run, "--prompt", long, "--tokens", 5)
    assert code == 0 and out.startswith(long) and "the prompt is 45 tokens" in err and "last 16 tokens" in err
    code, out, err = sample_main(capsys, text_run, "--prompt", long[:16], "--tokens", 5)
    assert code == 0 and "note:" not in err
    code, out, err = sample_main(capsys, bpe_run, "--prompt", long + " é😀", "--tokens", 20, "--seed", 2)
    assert code == 0 and out.startswith(long + " é😀") and "last 8 tokens" in err      # streamed BPE: whole chars
