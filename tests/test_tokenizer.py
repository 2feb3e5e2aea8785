"""The byte-level BPE tokenizer: exact round trips, determinism, trained on the train split only, the same
held-out characters as a char dataset, JSON stored and checked, the library imported only when used, and the
bits-per-character evaluation of benchmarks/bpc.py scoring every held-out token once."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, mpi_env

from benchmarks import bpc
from capstone.config import ModelConfig
from capstone.data import tokenizer as tk
from capstone.data.dataset import DatasetError, identity, load_meta
from capstone.data.tokens import TokenData
from capstone.model.params import Layout, init_params
from capstone.prepare import prepare

TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune — café, naïve, 😀.\n\n") * 40


def write(tmp_path, text, name="t.txt") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_round_trip_and_size():
    tok = tk.train_bpe(TEXT, 300)
    assert tok.vocab_size == 300 and tk.bpe_vocab_size(tok.json) == 300
    for text in (TEXT, "unseen: Ωμέγα 漢字 \t\r\n 🎉", " leading space", ""):
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and tok.decode(ids) == text              # bytes: anything round-trips
    assert len(tok.encode(TEXT)) < 0.7 * len(TEXT)                             # merges happened
    assert tk.train_bpe("ab" * 50, 1000).vocab_size < 1000                     # no more merges: smaller
    with pytest.raises(tk.TokenizerError, match="--vocab-size 100"):
        tk.train_bpe(TEXT, 100)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\)"):
        tok.decode([300])


def test_training_is_deterministic_across_processes():
    code = ("import sys; from capstone.data.tokenizer import train_bpe; "
            "sys.stdout.write(train_bpe(open(sys.argv[1]).read(), 400).json)")
    path = os.path.join(ROOT, "README.md")
    outs = [subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=mpi_env(), cwd=ROOT,
                           timeout=120).stdout for _ in range(2)]
    assert outs[0] and outs[0] == outs[1] == tk.train_bpe(open(path).read(), 400).json


def test_description_round_trip_and_differences():
    tok, char = tk.train_bpe(TEXT, 300), tk.CharTokenizer(tuple("abc"))
    assert tk.from_description(tok.describe()) == tok and tk.from_description(char.describe()) == char
    with pytest.raises(ValueError, match="sha256"):
        tk.from_description({**tok.describe(), "sha256": "0" * 64})
    assert tk.difference(tok, tok) == "" and "tokenizer is bpe" in tk.difference(tok, char)
    assert "only the checkpoint's has 'c'" in tk.difference(char, tk.CharTokenizer(tuple("abd")))
    assert "300 tokens" in tk.difference(tok, tk.train_bpe(TEXT, 299))


def test_bpe_dataset_same_held_out_characters_as_char(tmp_path):
    src = write(tmp_path, TEXT)
    prepare([src], str(tmp_path / "char"))
    s = prepare([src], str(tmp_path / "bpe"), tokenizer="bpe", vocab_size=300)
    char, bpe = load_meta(str(tmp_path / "char")), load_meta(str(tmp_path / "bpe"))
    assert (bpe.train.chars, bpe.val.chars) == (char.train.chars, char.val.chars) == (len(TEXT) - len(TEXT) // 10,
                                                                                     len(TEXT) // 10)
    val = np.fromfile(tmp_path / "bpe" / "val.bin", dtype="<u2")
    train = np.fromfile(tmp_path / "bpe" / "train.bin", dtype="<u2")
    assert bpe.decode(val) == TEXT[-(len(TEXT) // 10):] and bpe.decode(train) + bpe.decode(val) == TEXT
    assert len(val) == bpe.val.tokens == s["val"] < bpe.val.chars
    raw = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    assert raw["tokenizer"] == {"kind": "bpe", "file": "tokenizer.json", "sha256": bpe.tokenizer.sha256}
    ident = TokenData(str(tmp_path / "bpe"), 8, 2, 1).verify().identity()
    assert ident["format"] == "capstone-bpe-tokens" and ident["tokenizer"]["json"] == bpe.tokenizer.json
    assert ident["tokenizer_sha256"] == bpe.tokenizer.sha256 and ident["val_chars"] == bpe.val.chars
    assert ident == identity(bpe) and ident["digest"] != identity(char)["digest"]


def test_bpe_is_trained_on_the_train_split_only(tmp_path):
    """A word that occurs only in the last 10% of the characters gets no merge: the held-out text stays unseen."""
    text = "the cat sat on the mat. " * 90 + "qzqzqzqzqzqzqzqz " * 13
    assert text.index("qz") > len(text) - len(text) // 10
    prepare([write(tmp_path, text)], str(tmp_path / "bpe"), tokenizer="bpe", vocab_size=300)
    vocab = json.loads((tmp_path / "bpe" / "tokenizer.json").read_text())["model"]["vocab"]
    assert not [t for t in vocab if "qz" in t or "zq" in t] and [t for t in vocab if "cat" in t]


def test_a_replaced_tokenizer_json_is_refused(tmp_path):
    prepare([write(tmp_path, TEXT)], str(tmp_path / "bpe"), tokenizer="bpe", vocab_size=300)
    path = tmp_path / "bpe" / "tokenizer.json"
    path.write_text(path.read_text().replace('"Ġt"', '"Ġq"', 1))
    with pytest.raises(DatasetError, match=r"tokenizer\.json: its sha256 does not match meta\.json"):
        load_meta(str(tmp_path / "bpe"))


def test_the_library_is_imported_only_for_bpe(tmp_path, monkeypatch, capsys):
    src = write(tmp_path, TEXT)
    prepare([src], str(tmp_path / "bpe"), tokenizer="bpe", vocab_size=300)
    monkeypatch.setitem(sys.modules, "tokenizers", None)                   # as if it were not installed
    prepare([src], str(tmp_path / "char"))                                  # char: no library needed
    meta = load_meta(str(tmp_path / "bpe"))                                 # reading a BPE dataset neither
    assert meta.vocab_size == 300 and TokenData(str(tmp_path / "bpe"), 8, 2, 1).verify().identity()
    from capstone import prepare as cli
    assert cli.main([src, "--tokenizer", "bpe", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "pip install tokenizers==0.23.3" in err and "--tokenizer char" in err and not (tmp_path / "x").exists()
    with pytest.raises(tk.TokenizerError, match="pip install tokenizers"):
        meta.decode([1, 2])


def test_eval_windows_score_every_held_out_token_once():
    for n_val, T in ((100, 8), (96, 8), (9, 8), (1000, 64)):
        starts, tail = bpc.windows(n_val, T)
        scored = []
        for i, a in enumerate(starts):
            targets = list(range(a + 1 - T, a + 1))                        # val index of each target of the window
            scored += targets[T - tail:] if tail and i == len(starts) - 1 else targets
        assert sorted(scored) == list(range(n_val)), (n_val, T)


def test_heldout_nats_against_a_direct_sum(tmp_path):
    """benchmarks.bpc.heldout_nats equals the cross-entropy of each val token given the seq_len tokens before it,
    summed one window at a time; bits per character divides by the held-out characters."""
    prepare([write(tmp_path, TEXT[:1500])], str(tmp_path / "ds"))
    data = TokenData(str(tmp_path / "ds"), 8, 1, 0)
    cfg = ModelConfig(vocab_size=data.vocab_size, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    layout = Layout.for_model(cfg, 1)
    flat = init_params(layout, cfg, 3) + np.random.default_rng(1).normal(0, 0.2, layout.padded).astype(np.float32)
    stream = np.concatenate([data.train[-8:], data.val]).astype(np.int32)
    from capstone.model.gpt import logits
    want, done = 0.0, 8                                                    # stream position of the next val token
    while done < len(stream):
        a = min(done - 1, len(stream) - 9)
        z = logits(layout.groups(flat), stream[None, a:a + 8], cfg).astype(np.float64)
        for j in range(8):
            if a + 1 + j >= done:
                want += float(np.log(np.exp(z[j]).sum()) - z[j, stream[a + 1 + j]])
        done = a + 9
    assert bpc.heldout_nats(flat, cfg, data, batch=3) == pytest.approx(want, rel=1e-9)
    per = bpc.train_flops_per_token(cfg)
    assert per == 3 * (2 * (12 * 1 * 16 * 16 + 16 * cfg.vocab_size) + 4 * 1 * 8 * 16)
    assert math.isclose(want / load_meta(str(tmp_path / "ds")).val.chars / math.log(2),
                        want / 150 / math.log(2))
