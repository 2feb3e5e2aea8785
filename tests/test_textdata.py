"""capstone.data.tokens / dataset: strict meta.json, memmapped splits, verification, identity, DataStream-compatible
sampling, and a corrupted train.bin refused by the trainer."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from capstone.config import ConfigError, ModelConfig, TrainConfig
from capstone.data import open_data
from capstone.data.synthetic import DataStream

EVAL_SEQUENCES = 32  # DataStream's default held-out windows
from capstone.prepare import prepare
from capstone.data.tokens import DatasetError, TokenData, load_meta
from conftest import ROOT, mpi_env

T, B, SEED = 8, 3, 5


@pytest.fixture
def ds(tmp_path):
    """A random 3000-character text over 30 letters: every window of T+1 tokens is distinct."""
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyzäöü\n"), size=3000))
    (tmp_path / "t.txt").write_text(text, encoding="utf-8", newline="")
    prepare([str(tmp_path / "t.txt")], str(tmp_path / "ds"))
    return str(tmp_path / "ds")


def rewrite_meta(directory, change):
    path = os.path.join(directory, "meta.json")
    with open(path) as f:
        meta = json.load(f)
    text = change(meta)
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(meta))


def window_ids(data: TokenData, x, y) -> list[int]:
    """Which non-overlapping window of train.bin each (x, y) row is."""
    full = np.asarray(data.train, dtype=np.int32)
    lookup = {full[w * T:w * T + T + 1].tobytes(): w for w in range(data.n_windows)}
    assert len(lookup) == data.n_windows
    return [lookup[np.concatenate([xr, yr[-1:]]).tobytes()] for xr, yr in zip(x, y)]


def test_samples_are_a_pure_function_of_the_index(ds):
    a, b = TokenData(ds, T, B, SEED), TokenData(ds, T, B, SEED)
    n = a.n_windows
    x, y = a.samples(n - 7, 20)                                   # crosses the epoch boundary
    assert x.shape == y.shape == (20, T) and x.dtype == np.int32 and not isinstance(x, np.memmap)
    assert np.array_equal(x[:, 1:], y[:, :-1])
    for k in (0, 1, 7, 13, 20):
        x1, y1 = b.samples(n - 7, k)
        x2, y2 = b.samples(n - 7 + k, 20 - k)
        assert np.array_equal(np.concatenate([x1, x2]), x) and np.array_equal(np.concatenate([y1, y2]), y)
    assert not np.array_equal(TokenData(ds, T, B, SEED + 1).samples(n - 7, 20)[0], x)


def test_every_window_once_per_epoch(ds):
    data = TokenData(ds, T, B, SEED)
    n = data.n_windows
    epochs = [window_ids(data, *data.samples(e * n, n)) for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
    assert epochs[0] != epochs[1]


def test_same_scheme_as_datastream(ds):
    data = TokenData(ds, T, B, SEED)
    train = np.asarray(data.train, dtype=np.int32)
    corpus = np.concatenate([train, np.zeros(EVAL_SEQUENCES * T, np.int32)])     # DataStream holds these out
    stream = DataStream(corpus, T, B, SEED)
    assert stream.n_windows == data.n_windows
    for first, count in ((0, 5), (data.n_windows - 2, 6)):
        assert all(np.array_equal(p, q) for p, q in zip(stream.samples(first, count), data.samples(first, count)))
    for rank, micro in ((0, 0), (1, 1)):
        assert np.array_equal(stream.micro_batch(12, micro, rank, 2)[0], data.micro_batch(12, micro, rank, 2)[0])


def test_micro_batches_of_a_step_are_its_global_batch(ds):
    data, world, accum = TokenData(ds, T, B, SEED), 2, 3
    parts = {(j * world + r): data.micro_batch(40, j, r, world)[0] for j in range(accum) for r in range(world)}
    step = np.concatenate([parts[i] for i in range(accum * world)])
    assert np.array_equal(step, data.samples(40, B * accum * world)[0])


def test_splits_are_read_only_memmaps(ds):
    data = TokenData(ds, T, B, SEED)
    for arr, name in ((data.train, "train.bin"), (data.val, "val.bin")):
        assert isinstance(arr, np.memmap) and arr.mode == "r" and not arr.flags.writeable
        assert os.path.basename(arr.filename) == name and arr.dtype == np.dtype("<u2")


def test_val_batches_fixed_distinct_and_split_across_ranks(ds):
    a, b = TokenData(ds, T, B, SEED), TokenData(ds, T, B, SEED + 1)      # the seed does not matter
    count, m = 4, a.n_val_windows // 4
    batches = [a.val_batch(k, count) for k in range(m)]
    assert all(np.array_equal(p[0], q[0]) for p, q in zip(batches, (b.val_batch(k, count) for k in range(m))))
    rows = {np.concatenate([xr, yr[-1:]]).tobytes() for x, y in batches for xr, yr in zip(x, y)}
    assert len(rows) == m * count                                                   # no window twice
    val = np.asarray(a.val, dtype=np.int32)
    x, y = a.val_batch(1, count)
    for xr, yr in zip(x, y):
        start = int(np.flatnonzero([np.array_equal(val[s:s + T], xr) for s in range(0, len(val) - T, T)])[0]) * T
        assert np.array_equal(val[start + 1:start + T + 1], yr)
    shares = [a.val_batch(1, count, r, 3)[0] for r in range(3)]
    assert sum(len(s) for s in shares) == count
    assert all(np.array_equal(shares[r], x[r::3]) for r in range(3))
    with pytest.raises(ConfigError, match="count <="):
        a.val_batch(0, a.n_val_windows + 1)


def test_verify_identity_encode_decode(ds):
    data = TokenData(ds, T, B, SEED).verify()
    ident = data.identity()
    assert json.loads(json.dumps(ident)) == ident == TokenData(ds, 4, 1, 9).identity()
    assert ident["vocab_size"] == 30 and ident["train_tokens"] + ident["val_tokens"] == 3000
    assert ident["val_chars"] == 300 and ident["format"] == "capstone-char-tokens" and ident["version"] == 1
    assert ident["train_sha256"] == hashlib.sha256(open(data.train.filename, "rb").read()).hexdigest()
    assert ident["tokenizer"] == {"kind": "char", "chars": "".join(data.meta.chars)}
    assert ident["chars_sha256"] == hashlib.sha256("".join(data.meta.chars).encode()).hexdigest()
    assert len(ident["digest"]) == 64
    assert data.decode(data.encode("äbc\n")) == "äbc\n"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        data.encode("A")
    assert load_meta(ds).decode(data.train[:5]) == data.decode(data.train[:5]) and len(data.decode(data.train[:5])) == 5


def test_identity_tells_same_size_vocabularies_apart(tmp_path):
    """Two texts of the same length over 30 characters each, one character different: the digests differ."""
    rng = np.random.default_rng(0)
    for name, alphabet in (("a", "abcdefghijklmnopqrstuvwxyzäöü\n"), ("b", "abcdefghijklmnopqrstuvwxyzäöß\n")):
        (tmp_path / f"{name}.txt").write_text("".join(rng.choice(list(alphabet), size=3000)), encoding="utf-8")
        prepare([str(tmp_path / f"{name}.txt")], str(tmp_path / name))
    a, b = (TokenData(str(tmp_path / n), T, B, SEED).identity() for n in "ab")
    assert a["vocab_size"] == b["vocab_size"] == 30
    assert a["chars_sha256"] != b["chars_sha256"] and a["digest"] != b["digest"]


def test_flipped_byte_is_refused(ds):
    path = os.path.join(ds, "train.bin")
    with open(path, "r+b") as f:
        f.seek(101)
        byte = f.read(1)
        f.seek(101)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(DatasetError, match=r"not a valid dataset: .*train\.bin: sha256 .* does not match"):
        TokenData(ds, T, B, SEED).verify()


def test_token_id_beyond_vocab_is_refused(ds):
    path = os.path.join(ds, "val.bin")
    tokens = np.fromfile(path, dtype="<u2")
    tokens[3] = 30
    tokens.tofile(path)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    rewrite_meta(ds, lambda m: m["splits"]["val"].update(sha256=digest))
    with pytest.raises(DatasetError, match=r"val\.bin: holds token id 30 >= vocab_size 30"):
        TokenData(ds, T, B, SEED).verify()


def test_size_mismatch_and_short_split_are_refused(ds):
    with pytest.raises(ConfigError, match=r"--seq-len 400 is too long .*val\.bin holds 300 tokens.* --seq-len 299 or less") as exc:
        TokenData(ds, 400, B, SEED)                     # val holds 300 tokens: the window is the mistake
    assert not isinstance(exc.value, DatasetError) and "--force" not in str(exc.value)
    with open(os.path.join(ds, "train.bin"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(DatasetError, match=r"train\.bin: 100 bytes, but meta.json says"):
        TokenData(ds, T, B, SEED)


BAD_META = {
    "not json": lambda m: "{not json",
    "NaN": lambda m: json.dumps(m).replace('"version": 2', '"version": NaN'),
    "duplicate key": lambda m: json.dumps(m)[:-1] + ', "version": 2}',
    "not an object": lambda m: "[]",
    "format": lambda m: m.update(format="nanogpt"),
    "format list": lambda m: m.update(format=["capstone-tokens"]),
    "version": lambda m: m.update(version=3),
    "version 1 with a tokenizer": lambda m: m.update(version=1),
    "version bool": lambda m: m.update(version=True),
    "missing key": lambda m: m.pop("sources"),
    "unknown key": lambda m: m.update(extra=1),
    "dtype": lambda m: m.update(dtype="uint32"),
    "vocab type": lambda m: m.update(vocab_size="30"),
    "tokenizer kind": lambda m: m["tokenizer"].update(kind="wordpiece"),
    "tokenizer keys": lambda m: m["tokenizer"].update(extra=1),
    "bpe without its file": lambda m: m.update(tokenizer={"kind": "bpe", "file": "tokenizer.json", "sha256": "0" * 64}),
    "chars unsorted": lambda m: m["tokenizer"].update(chars=m["tokenizer"]["chars"][::-1]),
    "chars count": lambda m: m["tokenizer"].update(chars=m["tokenizer"]["chars"][:-1]),
    "chars list": lambda m: m["tokenizer"].update(chars=list(m["tokenizer"]["chars"])),
    "surrogate": lambda m: m["tokenizer"].update(chars=m["tokenizer"]["chars"][:-1] + "\ud800"),
    "tokens": lambda m: m["splits"]["train"].update(tokens=-1),
    "split chars": lambda m: m["splits"]["val"].update(chars=m["splits"]["val"]["chars"] + 1),
    "split chars missing": lambda m: m["splits"]["val"].pop("chars"),
    "sha256": lambda m: m["splits"]["val"].update(sha256="abc"),
    "file": lambda m: m["splits"]["train"].update(file="../train.bin"),
    "splits": lambda m: m["splits"].pop("val"),
    "sources": lambda m: m["sources"][0].update(chars=1),
}


def test_a_validation_split_too_short_for_the_eval_batch_says_what_fits(ds):
    """Each advised value fits (was: the count alone, no advice)."""
    def start(seq_len, eval_batch_size):
        return open_data(ModelConfig(vocab_size=40, seq_len=seq_len), TrainConfig(data=ds, eval_batch_size=eval_batch_size),
                         B)

    with pytest.raises(ConfigError, match=r"holds 2 sequences of 101 tokens, fewer than --eval-batch-size 8\. "
                                          r"Pass --eval-batch-size 2 or less, --seq-len 37 or less, or prepare"):
        start(100, 8)                                   # val holds 300 tokens
    assert start(100, 2)[0].n_val_windows == 2 and start(37, 8)[0].n_val_windows == 8


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_bad_meta_is_refused_cleanly(ds, case):
    rewrite_meta(ds, BAD_META[case])
    with pytest.raises(DatasetError, match=r"^not a valid dataset: .*(meta|tokenizer)\.json: .*capstone\.prepare"):
        TokenData(ds, T, B, SEED)


def test_missing_dataset(tmp_path):
    with pytest.raises(DatasetError, match="no such directory"):
        load_meta(str(tmp_path / "nope"))
    with pytest.raises(DatasetError, match=r"meta\.json: missing"):
        load_meta(str(tmp_path))


def test_data_that_is_a_text_file_gets_a_prepare_command_that_works(tmp_path):
    """--data story.txt: said to be a file, not a dataset; the suggested prepare writes elsewhere and loads."""
    story = tmp_path / "story.txt"
    story.write_text("once upon a time there was a tiny model\n" * 20)
    with pytest.raises(DatasetError) as exc:
        load_meta(str(story))
    said = str(exc.value)
    assert "--data " + str(story) + " is a file" in said and "no such directory" not in said, said
    command = said.split("`")[1].split()
    assert command[:4] == ["python", "-m", "capstone.prepare", str(story)] and command[4] == "--out", said
    assert command[5] != str(story) and os.path.dirname(command[5]) == str(tmp_path)
    prepare([str(story)], command[5])
    assert load_meta(command[5]).vocab_size > 0 and f"pass --data {command[5]}." in said


def test_eval_batch_is_val_batch_zero(ds):
    data = TokenData(ds, T, B, SEED)
    full = data.val_batch(0, 32)[0]
    assert np.array_equal(data.eval_batch(0, 1)[0], full) and np.array_equal(data.eval_batch(1, 2)[0], full[1::2])


def test_a_corrupted_train_bin_stops_the_trainer_cleanly(ds, tmp_path):
    """A flipped byte in train.bin: `capstone.train --data` exits 2 before training with one paragraph naming
    the file and how to re-create it; no traceback."""
    path = os.path.join(ds, "train.bin")
    with open(path, "r+b") as f:
        f.seek(11)
        byte = f.read(1)
        f.seek(11)
        f.write(bytes([byte[0] ^ 0x04]))
    cmd = ["mpirun", "-n", "1", "--oversubscribe", sys.executable, "-m", "capstone.train", "--data", ds, "--steps", "2",
           "--seq-len", str(T), "--out", str(tmp_path / "run")]
    res = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "train.bin: sha256" in res.stderr and "capstone.prepare" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")
