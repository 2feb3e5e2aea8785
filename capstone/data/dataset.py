"""The on-disk format of a prepared dataset: DIR/meta.json, checked strictly, and its identity.

`load_meta(DIR)` reads meta.json version 2 (format "capstone-tokens": a char or BPE tokenizer, split
sizes in tokens and characters) and version 1 (format "capstone-char-tokens", written before BPE),
and refuses anything else with a DatasetError that says how to re-create it. `identity(meta)` is
what a run records in each checkpoint: the digests, the vocabulary and the tokenizer itself.
"""

import hashlib
import json
import os
import pathlib
import re
from dataclasses import dataclass

from capstone.flags import paths
from capstone.config import ConfigError
from capstone.data.tokenizer import BPETokenizer, CharTokenizer, MAX_VOCAB, bpe_vocab_size, sha256_text

FORMAT, VERSION = "capstone-tokens", 2
FORMAT_V1, VERSION_V1 = "capstone-char-tokens", 1
TOKEN_FORMATS = {"char": "capstone-char-tokens", "bpe": "capstone-bpe-tokens"}   # identity()["format"]
META_FILE, TOKENIZER_FILE = paths.META_FILE, "tokenizer.json"
SPLITS = ("train", "val")
DTYPE_NAME = "uint16-le"
_KEYS = {1: {"format", "version", "dtype", "vocab_size", "chars", "splits", "sources"},
         2: {"format", "version", "dtype", "vocab_size", "tokenizer", "splits", "sources"}}
_HEX64 = re.compile(r"[0-9a-f]{64}")


class DatasetError(ConfigError):
    """DIR is not a valid prepared dataset; the message names the file and says what to do."""


def invalid(path: str, reason: str) -> DatasetError:
    return DatasetError(f"not a valid dataset: {path}: {reason}. Re-create it with "
                        f"`python -m capstone.prepare TEXT_FILE... --out {os.path.dirname(path) or '.'} --force`.")


def strict_json(text: str):
    """json.loads that refuses duplicate keys and NaN/Infinity."""
    def pairs(items):
        if len(dict(items)) != len(items):
            raise ValueError(f"duplicate key in {[k for k, _ in items]}")
        return dict(items)

    def constant(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)


@dataclass(frozen=True)
class Split:
    """One token file of a dataset: its path, its length in tokens and in characters, its sha256."""

    path: str
    tokens: int
    sha256: str
    chars: int


@dataclass(frozen=True)
class Source:
    """One input text of a dataset: its name as given to prepare, its length in characters, its sha256."""

    name: str
    chars: int
    sha256: str


@dataclass(frozen=True)
class Meta:
    """The checked contents of DIR/meta.json: tokenizer, splits and sources."""

    directory: str
    tokenizer: CharTokenizer | BPETokenizer
    train: Split
    val: Split
    sources: tuple[Source, ...]
    version: int = VERSION

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def chars(self) -> tuple[str, ...]:
        """The character vocabulary (empty for a BPE dataset)."""
        return getattr(self.tokenizer, "chars", ())

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)


def _check(ok: bool, path: str, reason: str) -> None:
    if not ok:
        raise invalid(path, reason)


def read_split(directory: str, path: str, name: str, entry, version: int) -> Split:
    """meta.json's `splits.<name>` entry (of meta.json `path`, format `version`), checked."""
    where, keys = f"splits.{name}", {"file", "tokens", "sha256"} | ({"chars"} if version == 2 else set())
    _check(isinstance(entry, dict) and set(entry) == keys, path,
           f"{where} must be an object with exactly the keys {', '.join(sorted(keys))}")
    _check(entry["file"] == f"{name}.bin", path, f"{where}.file must be {name}.bin, got {entry['file']!r}")
    for key in keys & {"tokens", "chars"}:
        _check(type(entry[key]) is int and entry[key] >= 0, path, f"{where}.{key} must be an integer >= 0")
    _check(isinstance(entry["sha256"], str) and _HEX64.fullmatch(entry["sha256"]) is not None, path,
           f"{where}.sha256 must be 64 lowercase hex digits")
    return Split(os.path.join(directory, entry["file"]), entry["tokens"], entry["sha256"],
                 entry.get("chars", entry["tokens"]))


def read_sources(path: str, sources) -> tuple[Source, ...]:
    """meta.json's `sources` list (of meta.json `path`), checked."""
    _check(isinstance(sources, list) and len(sources) >= 1, path, "sources must be a non-empty list")
    for s in sources:
        _check(isinstance(s, dict) and set(s) == {"name", "chars", "sha256"} and isinstance(s["name"], str)
               and type(s["chars"]) is int and s["chars"] >= 0 and isinstance(s["sha256"], str)
               and _HEX64.fullmatch(s["sha256"]) is not None, path,
               "each source must be an object {name: string, chars: integer >= 0, sha256: 64 hex digits}")
    return tuple(Source(s["name"], s["chars"], s["sha256"]) for s in sources)


def _chars(path: str, chars, size: int) -> CharTokenizer:
    _check(isinstance(chars, str), path, "chars must be a string (the vocabulary, one character per token id)")
    _check(len(chars) == size, path, f"chars has {len(chars)} characters but vocab_size is {size}")
    codes = [ord(c) for c in chars]
    _check(all(a < b for a, b in zip(codes, codes[1:])), path, "chars must be distinct and sorted by code point")
    _check(not any(0xD800 <= c <= 0xDFFF for c in codes), path, "chars must not hold surrogates (not text)")
    return CharTokenizer(tuple(chars))


def _bpe(directory: str, path: str, entry, size: int) -> BPETokenizer:
    _check(set(entry) == {"kind", "file", "sha256"} and entry["file"] == TOKENIZER_FILE, path,
           f"a bpe tokenizer entry must be {{kind, file: {TOKENIZER_FILE!r}, sha256}}")
    file = os.path.join(directory, TOKENIZER_FILE)
    try:
        text = pathlib.Path(file).read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise invalid(file, f"missing or unreadable ({getattr(exc, 'strerror', None) or exc})") from None
    _check(sha256_text(text) == entry["sha256"], file, "its sha256 does not match meta.json: the file is corrupt "
                                                       "or replaced")
    try:
        _check(bpe_vocab_size(text) == size, file, f"holds {bpe_vocab_size(text)} tokens but vocab_size is {size}")
    except ValueError as exc:
        raise invalid(file, str(exc)) from None
    return BPETokenizer(text)


def _tokenizer(directory: str, path: str, meta: dict):
    size = meta["vocab_size"]
    _check(type(size) is int and 1 <= size <= MAX_VOCAB, path, f"vocab_size must be an integer in [1, {MAX_VOCAB}]")
    if meta["version"] == 1:
        return _chars(path, meta["chars"], size)
    entry = meta["tokenizer"]
    _check(isinstance(entry, dict) and entry.get("kind") in ("char", "bpe"), path,
           "tokenizer must be an object whose kind is 'char' or 'bpe'")
    if entry["kind"] == "bpe":
        return _bpe(directory, path, entry, size)
    _check(set(entry) == {"kind", "chars"}, path, "a char tokenizer entry must be {kind, chars}")
    return _chars(path, entry["chars"], size)


def load_meta(directory: str, flag: str = "--data") -> Meta:
    """Read and strictly check DIR/meta.json (format, version, keys, types); DatasetError if anything is off.
    `flag`: the option that named DIR, for the messages (--data, prepare's --vocab-from)."""
    path = os.path.join(directory, META_FILE)
    paths.refuse(flag, directory, DatasetError)   # a dataset, or one a prepare is (or was) writing
    try:
        raw = strict_json(pathlib.Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:   # an interrupted prepare: re-creating it there is right
        raise invalid(path, "missing (an interrupted prepare leaves no meta.json)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise invalid(path, f"unreadable or not strict JSON ({exc})") from None
    _check(isinstance(raw, dict), path, "the top level must be a JSON object")
    _check(type(raw.get("version")) is int and isinstance(raw.get("format"), str)
           and (raw["format"], raw["version"]) in {(FORMAT, VERSION), (FORMAT_V1, VERSION_V1)}, path,
           f"format {raw.get('format')!r} version {raw.get('version')!r} is not one this code reads "
           f"({FORMAT!r} {VERSION} or {FORMAT_V1!r} {VERSION_V1})")
    keys = _KEYS[raw["version"]]
    _check(set(raw) == keys, path, f"keys must be exactly {sorted(keys)}; missing {sorted(keys - set(raw))}, "
                                   f"unknown {sorted(set(raw) - keys)}")
    _check(raw["dtype"] == DTYPE_NAME, path, f"dtype must be {DTYPE_NAME!r}, got {raw['dtype']!r}")
    tokenizer = _tokenizer(directory, path, raw)
    splits = raw["splits"]
    _check(isinstance(splits, dict) and set(splits) == set(SPLITS), path, "splits must have exactly train and val")
    train, val = (read_split(directory, path, name, splits[name], raw["version"]) for name in SPLITS)
    meta = Meta(directory, tokenizer, train, val, read_sources(path, raw["sources"]), raw["version"])
    total = sum(s.chars for s in meta.sources)
    _check(total == train.chars + val.chars, path, f"the sources hold {total} characters but the splits "
                                                   f"{train.chars} + {val.chars}")
    if tokenizer.kind == "char":
        _check(train.chars == train.tokens and val.chars == val.tokens, path,
               "a char dataset has one token per character in each split")
    return meta


def identity(meta: Meta) -> dict:
    """JSON-able description of a dataset that a checkpoint records and a resume or sampler compares: the
    digests, the vocabulary size and the tokenizer itself (not the directory: a moved dataset is the same)."""
    tok = meta.tokenizer
    out = {"format": TOKEN_FORMATS[tok.kind], "version": 1, "vocab_size": meta.vocab_size,
           ("chars_sha256" if tok.kind == "char" else "tokenizer_sha256"): tok.sha256,
           "train_tokens": meta.train.tokens, "train_sha256": meta.train.sha256,
           "val_tokens": meta.val.tokens, "val_sha256": meta.val.sha256, "val_chars": meta.val.chars}
    out["digest"] = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()
    out["tokenizer"] = tok.describe()
    return out
