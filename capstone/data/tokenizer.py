"""The two tokenizers of a prepared dataset: characters (the default) and byte-level BPE.

`CharTokenizer` maps each distinct character to an id (sorted by code point). `BPETokenizer` is a
byte-level BPE trained with Hugging Face `tokenizers` (pinned in scripts/setup) and kept as its JSON
text, never pickle; the library is imported only when a BPE is trained, encodes or decodes. Both
`describe()` themselves as JSON-able data that a checkpoint can carry and `from_description` rebuilds.
"""

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from capstone.config import ConfigError

TOKENIZERS_PIN = "tokenizers==0.23.3"
BYTE_ALPHABET = 256              # a byte-level BPE starts from every byte: any text encodes
GPT2_SPECIAL = "<|endoftext|>"   # GPT2Tokenizer's bos, eos and unk token by default: one id, 50256 in GPT-2
MAX_VOCAB = 65535                # uint16 ids 0..65534 (the size itself fits uint16 too)


class TokenizerError(ConfigError):
    """A tokenizer cannot be built or used; the message says what to do."""


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def library():
    """The Hugging Face `tokenizers` module (TokenizerError, saying how to install it, without it)."""
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(f"the BPE tokenizer needs the Hugging Face `tokenizers` library: pip install "
                             f"{TOKENIZERS_PIN} (scripts/setup installs it), or use --tokenizer char.") from None
    return tokenizers


@dataclass(frozen=True)
class CharTokenizer:
    """One token per character; token id i is chars[i] (chars sorted by code point)."""

    chars: tuple[str, ...]
    kind: ClassVar[str] = "char"

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def sha256(self) -> str:
        return sha256_text("".join(self.chars))

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int32) of text; every character must be in the vocabulary (ValueError)."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return np.array([index[c] for c in text], dtype=np.int32)
        except KeyError as exc:
            c = exc.args[0]
            raise ValueError(f"character {c!r} (U+{ord(c):04X}) is not in the vocabulary ({self.vocab_size} "
                             f"characters); use only characters of the prepared text") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in _checked_ids(ids, self.vocab_size).tolist())

    def describe(self) -> dict:
        return {"kind": self.kind, "chars": "".join(self.chars)}


@dataclass(frozen=True)
class BPETokenizer:
    """A byte-level BPE, held as the JSON text of a Hugging Face `tokenizers.Tokenizer`."""

    json: str
    kind: ClassVar[str] = "bpe"

    @functools.cached_property
    def _tok(self):
        try:
            return library().Tokenizer.from_str(self.json)
        except Exception as exc:    # the library raises its own exception types
            raise TokenizerError(f"the BPE tokenizer JSON cannot be loaded ({exc}); prepare the dataset "
                                 f"again with --tokenizer bpe.") from None

    @property
    def vocab_size(self) -> int:
        return bpe_vocab_size(self.json)

    @property
    def sha256(self) -> str:
        return sha256_text(self.json)

    def encode(self, text: str) -> np.ndarray:
        return np.array(self._tok.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode(_checked_ids(ids, self.vocab_size).tolist(), skip_special_tokens=False)

    def describe(self) -> dict:
        return {"kind": self.kind, "sha256": self.sha256, "json": self.json}


def _checked_ids(ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids


def bpe_vocab_size(text: str) -> int:
    """Entries of a tokenizer JSON's model vocabulary, read without the library (ValueError if not BPE, or
    if an added token is not an entry of it: GPT-2's special tokens are, with their own ids)."""
    try:
        spec = json.loads(text)
        vocab = spec["model"]["vocab"]
        if spec["model"].get("type") != "BPE" or not isinstance(vocab, dict) or \
                any(vocab.get(t["content"]) != t["id"] for t in spec.get("added_tokens") or []):
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError("not the JSON of a byte-level BPE tokenizer whose added tokens are in its vocabulary") \
            from None
    return len(vocab)


def check_bpe_options(vocab_size: int | None):
    """Refuse a BPE vocabulary size out of range, or a missing library, before any work is done; the library."""
    if vocab_size is not None and not BYTE_ALPHABET <= vocab_size <= MAX_VOCAB:
        raise TokenizerError(f"--vocab-size {vocab_size}: a byte-level BPE needs {BYTE_ALPHABET} ids for the bytes "
                             f"and uint16 ids allow at most {MAX_VOCAB}; pass e.g. --vocab-size 512.")
    return library()


def train_bpe(text: str, vocab_size: int) -> BPETokenizer:
    """A byte-level BPE (GPT-2 pre-tokenization, every byte in the alphabet) trained on `text`; deterministic."""
    lib = check_bpe_options(vocab_size)
    tok = lib.Tokenizer(lib.models.BPE())
    tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    return BPETokenizer(tok.to_str())


def from_gpt2_files(vocab: str, merges: str, special: bool = True) -> BPETokenizer:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (capstone.gpt2.hf): the same ids as
    transformers' GPT2Tokenizer, its special tokens matched in the text as one id each (`special_tokens`;
    False: every text is ordinary bytes, <|endoftext|> 11 tokens of it)."""
    lib = library()
    try:
        tok = lib.Tokenizer(lib.models.BPE.from_file(vocab, merges))
    except Exception as exc:    # the library's own exception types
        raise TokenizerError(f"{vocab} and {merges} are not a GPT-2 BPE vocabulary ({exc}).") from None
    tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = lib.decoders.ByteLevel()
    if special:
        tok.add_special_tokens([lib.AddedToken(t, special=True) for t in special_tokens(os.path.dirname(vocab),
                                                                                          tok.get_vocab())])
    return BPETokenizer(tok.to_str())


def special_tokens(directory: str, vocab: dict) -> list[str]:
    """The special tokens GPT2Tokenizer matches in a text of `directory`'s model: GPT-2's <|endoftext|>
    and those its special_tokens_map.json and tokenizer_config.json name, each one its vocabulary holds
    (one that it does not would be a new id, beyond the model's embedding: left out)."""
    names = [GPT2_SPECIAL]
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(directory, name)) as f:
                spec = json.load(f)
        except (OSError, ValueError):
            continue
        spec = spec if isinstance(spec, dict) else {}
        for value in [*spec.values(), *(spec.get("added_tokens_decoder") or {}).values()]:
            content = value.get("content") if isinstance(value, dict) else value
            if isinstance(content, str) and content in vocab and content not in names:
                names.append(content)
    return [t for t in names if t in vocab]


def from_description(desc) -> CharTokenizer | BPETokenizer:
    """Rebuild a tokenizer from `describe()`'s output (ValueError if it is not one)."""
    if isinstance(desc, dict) and desc.get("kind") == "char" and isinstance(desc.get("chars"), str):
        return CharTokenizer(tuple(desc["chars"]))
    if isinstance(desc, dict) and desc.get("kind") == "bpe" and isinstance(desc.get("json"), str):
        tok = BPETokenizer(desc["json"])
        if tok.sha256 != desc.get("sha256"):
            raise ValueError(f"the BPE JSON's sha256 {tok.sha256[:16]}... differs from the recorded one")
        bpe_vocab_size(tok.json)
        return tok
    raise ValueError("not a tokenizer description ({'kind': 'char', 'chars': ...} or {'kind': 'bpe', ...})")


def _ids_of(text: str) -> str:
    """A BPE JSON without its added tokens: what its ids mean."""
    spec = json.loads(text)
    spec.pop("added_tokens", None)
    return json.dumps(spec, sort_keys=True)


def _quote(chars) -> str:
    text = "".join(sorted(chars))
    return repr(text if len(text) <= 24 else text[:24]) + ("" if len(text) <= 24 else f" and {len(text) - 24} more")


def difference(mine, theirs, names=("the checkpoint's", "the dataset's")) -> str:
    """What differs between two tokenizers, in words ("" if they are the same)."""
    if mine.kind != theirs.kind:
        return f"{names[0]} tokenizer is {mine.kind}, {names[1]} is {theirs.kind}"
    if mine.sha256 == theirs.sha256:
        return ""
    if mine.kind == "bpe":   # "": the same ids, one matching special tokens in a text (prepare --no-special-tokens)
        return "" if _ids_of(mine.json) == _ids_of(theirs.json) else (
            f"{names[0]} BPE ({mine.vocab_size} tokens, sha256 {mine.sha256[:16]}...) is not {names[1]} "
            f"({theirs.vocab_size} tokens, sha256 {theirs.sha256[:16]}...)")
    a, b = set(mine.chars), set(theirs.chars)
    parts = [f"{names[0]} vocabulary has {mine.vocab_size} characters, {names[1]} {theirs.vocab_size}"]
    parts += [f"only {name} has {_quote(only)}" for name, only in ((names[0], a - b), (names[1], b - a)) if only]
    return ", ".join(parts)
