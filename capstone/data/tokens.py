"""Character-level token data prepared by `python -m capstone.prepare` (docs/data.md).

`load_meta(DIR)` reads and strictly checks DIR/meta.json (vocabulary, split sizes, digests).
`TokenData` memory-maps DIR/train.bin and DIR/val.bin read-only and serves batches with the same
interface and sample indexing as `capstone.data.DataStream`: sample i is a window of T+1 tokens
chosen by a seeded per-epoch permutation of the non-overlapping windows of train.bin, so batches
are a pure function of (data, seed, global sample index). Validation batches come from a fixed
permutation of val.bin's windows that does not depend on the seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from capstone.config import ConfigError

FORMAT = "capstone-char-tokens"
VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
DTYPE = np.dtype("<u2")         # uint16, little-endian
DTYPE_NAME = "uint16-le"
MAX_VOCAB = 65535               # ids 0..65534: the vocabulary size itself fits uint16 too
VAL_KEY = 0x5EA1                # key of the fixed validation permutation (not the training seed)
EVAL_WINDOWS = 32               # eval_batch size, as capstone.data.EVAL_SEQUENCES
CHUNK = 1 << 20                 # bytes per read when hashing / range-checking a .bin
_KEYS = {"format", "version", "dtype", "vocab_size", "chars", "splits", "sources"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


class DatasetError(ConfigError):
    """DIR is not a valid prepared dataset; the message names the file and says what to do."""


def invalid(path: str, reason: str) -> DatasetError:
    return DatasetError(f"not a valid dataset: {path}: {reason}. Re-create it with "
                        f"`python -m capstone.prepare TEXT_FILE... --out {os.path.dirname(path) or '.'}`.")


def strict_json(text: str):
    """json.loads that refuses duplicate keys and NaN/Infinity."""
    def pairs(items):
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate key in {keys}")
        return dict(items)

    def constant(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)


@dataclass(frozen=True)
class Split:
    """One token file of a dataset: its path, its length in tokens and its sha256."""

    path: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class Source:
    """One input text of a dataset: its name as given to prepare, its length in characters, its sha256."""

    name: str
    chars: int
    sha256: str


@dataclass(frozen=True)
class Meta:
    """The checked contents of DIR/meta.json: vocabulary, splits and sources."""

    directory: str
    chars: tuple[str, ...]
    train: Split
    val: Split
    sources: tuple[Source, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of text; every character must be in the vocabulary."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return np.array([index[c] for c in text], dtype=np.int32)
        except KeyError as exc:
            c = exc.args[0]
            raise ValueError(f"character {c!r} (U+{ord(c):04X}) is not in the vocabulary of {self.directory} "
                             f"({self.vocab_size} characters); use only characters of the prepared text") from None

    def decode(self, ids) -> str:
        """Text of a sequence of token ids (each in [0, vocab_size))."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {ids.min()}..{ids.max()}")
        return "".join(self.chars[i] for i in ids.tolist())


def _check(ok: bool, path: str, reason: str) -> None:
    if not ok:
        raise invalid(path, reason)


def _split(directory: str, path: str, name: str, entry) -> Split:
    where = f"splits.{name}"
    _check(isinstance(entry, dict) and set(entry) == {"file", "tokens", "sha256"}, path,
           f"{where} must be an object with exactly the keys file, tokens, sha256")
    _check(entry["file"] == f"{name}.bin", path, f"{where}.file must be {name}.bin, got {entry['file']!r}")
    _check(type(entry["tokens"]) is int and entry["tokens"] >= 0, path, f"{where}.tokens must be an integer >= 0")
    _check(isinstance(entry["sha256"], str) and _HEX64.fullmatch(entry["sha256"]) is not None, path,
           f"{where}.sha256 must be 64 lowercase hex digits")
    return Split(os.path.join(directory, entry["file"]), entry["tokens"], entry["sha256"])


def _sources(path: str, sources) -> tuple[Source, ...]:
    _check(isinstance(sources, list) and len(sources) >= 1, path, "sources must be a non-empty list")
    for s in sources:
        _check(isinstance(s, dict) and set(s) == {"name", "chars", "sha256"} and isinstance(s["name"], str)
               and type(s["chars"]) is int and s["chars"] >= 0 and isinstance(s["sha256"], str)
               and _HEX64.fullmatch(s["sha256"]) is not None, path,
               "each source must be an object {name: string, chars: integer >= 0, sha256: 64 hex digits}")
    return tuple(Source(s["name"], s["chars"], s["sha256"]) for s in sources)


def _chars(path: str, meta: dict) -> tuple[str, ...]:
    chars, size = meta["chars"], meta["vocab_size"]
    _check(type(size) is int and 1 <= size <= MAX_VOCAB, path, f"vocab_size must be an integer in [1, {MAX_VOCAB}]")
    _check(isinstance(chars, str), path, "chars must be a string (the vocabulary, one character per token id)")
    _check(len(chars) == size, path, f"chars has {len(chars)} characters but vocab_size is {size}")
    codes = [ord(c) for c in chars]
    _check(all(a < b for a, b in zip(codes, codes[1:])), path, "chars must be distinct and sorted by code point")
    _check(not any(0xD800 <= c <= 0xDFFF for c in codes), path, "chars must not hold surrogates (not text)")
    return tuple(chars)


def load_meta(directory: str) -> Meta:
    """Read and strictly check DIR/meta.json (format, version, keys, types); DatasetError if anything is off."""
    path = os.path.join(directory, META_FILE)
    if not os.path.isdir(directory):
        raise DatasetError(f"not a valid dataset: {directory}: no such directory. Prepare one with "
                           f"`python -m capstone.prepare TEXT_FILE... --out {directory}`.")
    try:
        with open(path, "rb") as f:
            meta = strict_json(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise invalid(path, "missing (an interrupted prepare leaves no meta.json)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise invalid(path, f"unreadable or not strict JSON ({exc})") from None
    _check(isinstance(meta, dict), path, "the top level must be a JSON object")
    _check(meta.get("format") == FORMAT, path, f"format must be {FORMAT!r}, got {meta.get('format')!r}")
    _check(type(meta.get("version")) is int and meta["version"] == VERSION, path,
           f"version {meta.get('version')!r} is not supported (this code reads version {VERSION})")
    _check(set(meta) == _KEYS, path, f"keys must be exactly {sorted(_KEYS)}; missing {sorted(_KEYS - set(meta))}, "
                                     f"unknown {sorted(set(meta) - _KEYS)}")
    _check(meta["dtype"] == DTYPE_NAME, path, f"dtype must be {DTYPE_NAME!r}, got {meta['dtype']!r}")
    chars = _chars(path, meta)
    splits = meta["splits"]
    _check(isinstance(splits, dict) and set(splits) == set(SPLITS), path, "splits must have exactly train and val")
    meta = Meta(directory, chars, _split(directory, path, "train", splits["train"]),
                _split(directory, path, "val", splits["val"]), _sources(path, meta["sources"]))
    total = sum(s.chars for s in meta.sources)
    _check(total == meta.train.tokens + meta.val.tokens, path, f"the sources hold {total} characters but the "
           f"splits {meta.train.tokens} + {meta.val.tokens} tokens")
    return meta


def _memmap(split: Split) -> np.memmap:
    try:
        size = os.path.getsize(split.path)
    except OSError:
        raise invalid(split.path, "missing or unreadable") from None
    _check(size == split.tokens * DTYPE.itemsize, split.path,
           f"{size} bytes, but meta.json says {split.tokens} tokens = {split.tokens * DTYPE.itemsize} bytes")
    _check(split.tokens >= 2, split.path, f"holds {split.tokens} tokens, fewer than one input and one target")
    return np.memmap(split.path, dtype=DTYPE, mode="r", shape=(split.tokens,))


class TokenData:
    """Training and validation batches from a prepared dataset, like DataStream (same indexing)."""

    def __init__(self, directory: str, seq_len: int, batch_size: int, seed: int):
        if seq_len < 1 or batch_size < 1:
            raise ConfigError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        self.meta = load_meta(directory)
        self.T, self.B, self.seed = seq_len, batch_size, seed
        self.train, self.val = _memmap(self.meta.train), _memmap(self.meta.val)
        self.n_windows = (self.meta.train.tokens - 1) // seq_len
        self.n_val_windows = (self.meta.val.tokens - 1) // seq_len
        for split, n in ((self.meta.train, self.n_windows), (self.meta.val, self.n_val_windows)):
            _check(n >= 1, split.path, f"{split.tokens} tokens are shorter than one window of seq_len+1 = "
                                       f"{seq_len + 1} tokens; use a smaller --seq-len or a longer text")
        self._perms: dict[int, np.ndarray] = {}
        self._val_perm = np.random.default_rng([VAL_KEY, self.n_val_windows]).permutation(self.n_val_windows)

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    def verify(self) -> "TokenData":
        """Check each .bin's sha256 against meta.json and every token id < vocab_size (chunked reads)."""
        for split in (self.meta.train, self.meta.val):
            h, top = hashlib.sha256(), -1
            with open(split.path, "rb") as f:
                while block := f.read(CHUNK):
                    h.update(block)
                    top = max(top, int(np.frombuffer(block, dtype=DTYPE).max()))
            _check(h.hexdigest() == split.sha256, split.path,
                   f"sha256 {h.hexdigest()} does not match meta.json ({split.sha256}): the file is corrupt or replaced")
            _check(top < self.vocab_size, split.path, f"holds token id {top} >= vocab_size {self.vocab_size}")
        return self

    def identity(self) -> dict:
        """JSON-able description of the data that a resume can compare (digests, vocabulary, sizes)."""
        m = self.meta
        return {"format": FORMAT, "version": VERSION, "vocab_size": m.vocab_size,
                "chars_sha256": hashlib.sha256("".join(m.chars).encode("utf-8")).hexdigest(),
                "train_tokens": m.train.tokens, "train_sha256": m.train.sha256,
                "val_tokens": m.val.tokens, "val_sha256": m.val.sha256}

    def encode(self, text: str) -> np.ndarray:
        return self.meta.encode(text)

    def decode(self, ids) -> str:
        return self.meta.decode(ids)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:   # a batch spans at most a few epochs; keep the cache small
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng([self.seed, 0xDA7A, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def _windows(self, tokens: np.memmap, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        windows = tokens[starts[:, None] + np.arange(self.T + 1)].astype(np.int32)   # (count, T+1), reads only these
        return windows[:, :-1], windows[:, 1:]

    def samples(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets (count, T) int32 for global training samples [first, first+count)."""
        if first < 0 or count < 0:
            raise ValueError(f"first and count must be >= 0, got {first} and {count}")
        epochs, within = np.divmod(np.arange(first, first + count, dtype=np.int64), self.n_windows)
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            windows[sel] = self._perm(epoch)[within[sel]]
        return self._windows(self.train, windows * self.T)

    def micro_batch(self, cursor: int, micro: int, rank: int, world: int):
        """Rank `rank`'s micro-batch `micro` of the step whose first global sample is `cursor`."""
        return self.samples(cursor + (micro * world + rank) * self.B, self.B)

    def val_batch(self, k: int, count: int, rank: int = 0, world: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Rows rank, rank+world, ... of validation batch k: windows k*count .. (k+1)*count-1 of a fixed
        permutation of val.bin's windows (wrapping around); batches 0..M-1 are distinct while M*count <= n_val_windows."""
        if k < 0 or not 1 <= count <= self.n_val_windows:
            raise ConfigError(f"validation batch {k} of {count} windows: need k >= 0 and 1 <= count <= "
                              f"{self.n_val_windows} (the windows of seq_len+1 tokens in {self.meta.val.path})")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world), got rank {rank} of world {world}")
        index = (k * count + np.arange(count, dtype=np.int64)[rank::world]) % self.n_val_windows
        return self._windows(self.val, self._val_perm[index] * self.T)

    def eval_batch(self, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        """DataStream's fixed held-out batch: rank `rank`'s rows of val_batch(0, EVAL_WINDOWS) (fewer if val is short)."""
        return self.val_batch(0, min(EVAL_WINDOWS, self.n_val_windows), rank, world)
