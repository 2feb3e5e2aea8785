"""`python -m capstone.prepare TEXT_FILE... --out DIR [--tokenizer char|bpe]`: UTF-8 text to a token dataset.

The inputs (text files in the order given, .tar.gz archives, or the recipe name `shakespeare`;
capstone.data.sources) are concatenated and split by characters BEFORE tokenizing: the first 90%
is train, the last 10% val, whatever the tokenizer, so every tokenizer is judged on the same held-out
characters. `char` (default) makes each distinct character a token; `bpe` trains a byte-level BPE on
the train characters only and stores it as DIR/tokenizer.json. DIR gets train.bin and val.bin
(uint16 little-endian ids) and meta.json (docs/data.md). A DIR that holds another dataset, or other
files, is refused without --force; the same inputs again leave it as it is. Errors exit 2 with one
paragraph and write nothing.
"""

import argparse
import hashlib
import json
import os
import pathlib
import sys
import time
from dataclasses import dataclass

import numpy as np

from capstone.checkpoint.files import fsync_path, write_atomic
from capstone.flags import paths
from capstone.config import ConfigError
from capstone.data.dataset import (DTYPE_NAME, FORMAT, META_FILE, SPLITS, TOKENIZER_FILE, VERSION, DatasetError, Meta,
                                   identity, load_meta, read_sources, read_split)
from capstone.data.sources import RECIPES, PrepareError, Text, read_inputs
from capstone.data.tokenizer import MAX_VOCAB, BPETokenizer, CharTokenizer, check_bpe_options, train_bpe
from capstone.flags.pipe import fail, run_tool

VAL_FRACTION = 10               # the last 1/10 of the characters is the validation split
MIN_VAL_TOKENS = 2              # one input and one target
DTYPE = np.dtype("<u2")
DEFAULT_BPE_VOCAB = 512


@dataclass(frozen=True)
class Dataset:
    """A dataset ready to write: its tokenizer, the split token ids and character counts, its sources."""

    tokenizer: CharTokenizer | BPETokenizer
    train: np.ndarray
    val: np.ndarray
    train_chars: int
    val_chars: int
    texts: tuple[Text, ...]

    def files(self) -> dict[str, bytes]:
        """name -> bytes of every file of DIR, meta.json last."""
        tok = self.tokenizer
        bins = {"train.bin": self.train.astype(DTYPE).tobytes(), "val.bin": self.val.astype(DTYPE).tobytes()}
        if tok.kind == "bpe":
            bins[TOKENIZER_FILE] = tok.json.encode("utf-8")
        entry = tok.describe() if tok.kind == "char" else {"kind": "bpe", "file": TOKENIZER_FILE, "sha256": tok.sha256}
        splits = {name: {"file": f"{name}.bin", "tokens": len(bins[f"{name}.bin"]) // DTYPE.itemsize, "chars": chars,
                         "sha256": hashlib.sha256(bins[f"{name}.bin"]).hexdigest()}
                  for name, chars in (("train", self.train_chars), ("val", self.val_chars))}
        meta = {"format": FORMAT, "version": VERSION, "dtype": DTYPE_NAME, "vocab_size": tok.vocab_size,
                "tokenizer": entry, "splits": splits,
                "sources": [{"name": t.name, "chars": len(t.text), "sha256": t.sha256} for t in self.texts]}
        return {**bins, META_FILE: (json.dumps(meta, indent=1, ensure_ascii=True) + "\n").encode("ascii")}


def char_tokenizer(text: str) -> tuple[CharTokenizer, np.ndarray]:
    """The sorted distinct characters of text and the uint16 id of every character."""
    uniq, ids = np.unique(np.frombuffer(text.encode("utf-32-le"), dtype="<u4"), return_inverse=True)
    if len(uniq) > MAX_VOCAB:
        raise PrepareError(f"the text has {len(uniq)} distinct characters, but uint16 token ids hold at most "
                           f"{MAX_VOCAB}; character-level tokens need a smaller alphabet: drop or map rare "
                           f"characters before preparing, or use --tokenizer bpe.")
    return CharTokenizer(tuple(chr(c) for c in uniq.tolist())), ids.astype(DTYPE)


def split_text(text: str) -> int:
    """The number of characters of the validation split: the last 1/VAL_FRACTION, rounded down."""
    n_val = len(text) // VAL_FRACTION
    if not text:
        raise PrepareError("the text is empty: nothing to train on. Pass files that contain text.")
    if n_val < MIN_VAL_TOKENS:
        raise PrepareError(f"the text has {len(text)} characters: its last 10% ({n_val}) is too short for a "
                           f"validation split of {MIN_VAL_TOKENS} tokens; pass at least "
                           f"{MIN_VAL_TOKENS * VAL_FRACTION} characters.")
    return n_val


def reuse(tok: CharTokenizer | BPETokenizer, text: str, n_train: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    """The splits encoded with another dataset's tokenizer (--vocab-from); every character must be in a
    char vocabulary (the refusal lists those that are not)."""
    missing = sorted(set(text) - set(tok.chars)) if tok.kind == "char" else []
    if missing:
        listed = ", ".join(f"{c!r} x{text.count(c)}" for c in missing[:10])
        raise PrepareError(f"the text has {len(missing)} character(s) that the vocabulary of --vocab-from {source} "
                           f"lacks: {listed}{' ...' if len(missing) > 10 else ''}. Replace or remove them (e.g. "
                           f"with sed or tr) and prepare again, or prepare without --vocab-from (a new vocabulary).")
    return tok.encode(text[:n_train]).astype(DTYPE), tok.encode(text[n_train:]).astype(DTYPE)


def build(texts: list[Text], kind: str, vocab_size: int | None, vocab_from: str | None = None,
          given: BPETokenizer | None = None) -> Dataset:
    """Split the text by characters, then tokenize each split (a BPE is trained on the train split only;
    `given`: this tokenizer instead, e.g. that of the dataset directory `vocab_from`, named in refusals)."""
    text = "".join(t.text for t in texts)
    n_val = split_text(text)
    n_train = len(text) - n_val
    if given is not None:
        tok = given
        train, val = reuse(tok, text, n_train, vocab_from)
    elif kind == "char":
        tok, ids = char_tokenizer(text)
        train, val = ids[:n_train], ids[n_train:]
    else:
        tok = train_bpe(text[:n_train], vocab_size or DEFAULT_BPE_VOCAB)
        train, val = tok.encode(text[:n_train]), tok.encode(text[n_train:])
        if min(len(train), len(val)) < MIN_VAL_TOKENS:
            raise PrepareError(f"the text is too short: its BPE splits hold {len(train)} and {len(val)} tokens, "
                               f"fewer than {MIN_VAL_TOKENS}; pass a longer text or use --tokenizer char.")
    return Dataset(tok, train, val, n_train, n_val, tuple(texts))


def write_dataset(out: str, files: dict[str, bytes]) -> None:
    """Write DIR: drop the old meta.json (and a stale tokenizer.json) first, then each file atomically, meta.json last."""
    os.makedirs(out, exist_ok=True)
    for name in (META_FILE, TOKENIZER_FILE):
        pathlib.Path(out, name).unlink(missing_ok=True)
    for name, data in files.items():
        write_atomic(os.path.join(out, name), data)
    fsync_path(out)


def _describe(ident: dict, sources) -> str:
    return (f"digest {ident['digest'][:12]}: {ident['tokenizer']['kind']} tokens, vocab {ident['vocab_size']}, "
            f"{len(sources)} source(s) from {sources[0].name if sources else '?'}")


def _holds_exactly(out: str, files: dict[str, bytes]) -> bool:
    """DIR's dataset files are byte for byte `files` (and no stale tokenizer.json)."""
    if TOKENIZER_FILE not in files and os.path.lexists(os.path.join(out, TOKENIZER_FILE)):
        return False
    try:   # a file's size first: a different one is not read
        return all(os.path.getsize(os.path.join(out, name)) == len(data) and
                   pathlib.Path(out, name).read_bytes() == data for name, data in files.items())
    except OSError:
        return False


def target(out: str, data: Dataset, files: dict[str, bytes], force: bool) -> str:
    """What --out holds: "new" (nothing, or an interrupted prepare's files), "same" (this dataset),
    "unchanged" (byte for byte), "replace" (something else, with --force). PrepareError without --force."""
    found = paths.kind(out)
    if found in (paths.Kind.MISSING, paths.Kind.EMPTY):
        return "new"
    names = os.listdir(out)
    foreign = sorted(n for n in names if not paths.dataset_file(n))
    if foreign and not force:
        raise PrepareError(f"--out {out} is not empty and is not a dataset: it holds {foreign[:3]}"
                           f"{' and more' if len(foreign) > 3 else ''} ({found.value}). Pass a new or empty "
                           f"directory as --out, or add --force to write the dataset files next to them.")
    if META_FILE not in names:
        return "new"
    new = identity(load_written(data, files))
    try:
        old_meta = load_meta(out)
    except DatasetError as exc:
        if force:
            return "replace"
        raise PrepareError(f"--out {out} holds a damaged dataset ({exc}) Add --force to replace it, or pass "
                           f"another --out.") from None
    old = identity(old_meta)
    if old["digest"] == new["digest"]:
        return "unchanged" if _holds_exactly(out, files) else "same"
    if force:
        return "replace"
    raise PrepareError(f"--out {out} already holds another dataset ({_describe(old, old_meta.sources)}); these inputs "
                       f"make {_describe(new, data.texts)}. Runs trained on {out} could no longer resume or sample "
                       f"with --data {out}. Pass a new --out directory, or add --force to replace it.")


def load_written(data: Dataset, files: dict[str, bytes]):
    """The Meta that `files` describe, as load_meta would read it back (without writing anything)."""
    raw = json.loads(files[META_FILE])
    train, val = (read_split("", META_FILE, name, raw["splits"][name], VERSION) for name in SPLITS)
    return Meta("", data.tokenizer, train, val, read_sources(META_FILE, raw["sources"]))


def prepare(inputs: list[str], out: str, members: str | None = None, tokenizer: str = "char",
            vocab_size: int | None = None, force: bool = False, vocab_from: str | None = None,
            tokenizer_from: str | None = None, special: bool = True) -> dict:
    """Check everything, then write DIR; returns a summary. Raises PrepareError (nothing written).
    `tokenizer_from`: a GPT-2 directory whose vocab.json + merges.txt tokenize the text (capstone.gpt2.hf),
    its special tokens (<|endoftext|>) matched as one id each unless `special` is False."""
    paths.refuse("prepare --out", out, PrepareError)
    if tokenizer == "char" and vocab_size is not None:
        raise PrepareError(f"--vocab-size {vocab_size} applies to --tokenizer bpe only: a char dataset's vocabulary "
                           f"is the text's distinct characters. Drop --vocab-size, or add --tokenizer bpe.")
    if tokenizer == "bpe":
        check_bpe_options(vocab_size)   # before any download
    # a bad --vocab-from directory: its DatasetError, before reading
    given = None if vocab_from is None else load_meta(vocab_from, "--vocab-from").tokenizer
    if tokenizer_from is not None:
        from capstone.gpt2.hf import gpt2_tokenizer
        given = gpt2_tokenizer(tokenizer_from, special)
    texts = read_inputs(inputs, members)
    data = build(texts, tokenizer, vocab_size, vocab_from, given)
    files = data.files()
    state = target(out, data, files, force)
    if state != "unchanged":
        try:
            write_dataset(out, files)
        except OSError as exc:
            now = "no dataset was written (nothing was there before)" if state == "new" else \
                "it holds no valid dataset now"
            raise PrepareError(f"cannot write {out} ({exc}); {now}. Check the path, its permissions and free "
                               f"space, then run again.") from None
    return {"state": state, "chars": data.train_chars + data.val_chars, "files": len(texts), "kind": data.tokenizer.kind,
            "vocab_size": data.tokenizer.vocab_size, "train": len(data.train), "val": len(data.val),
            "val_chars": data.val_chars, "digest": identity(load_written(data, files))["digest"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m capstone.prepare", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Turn UTF-8 text into a token dataset for training: DIR/train.bin (first 90% of the characters), "
                    "DIR/val.bin (last 10%), uint16 little-endian ids, DIR/meta.json and, for BPE, DIR/tokenizer.json. "
                    "See docs/data.md.")
    p.add_argument("inputs", nargs="+", metavar="TEXT_FILE",
                   help=f"UTF-8 text files (concatenated in this order), .tar.gz archives, or a recipe: {sorted(RECIPES)}")
    p.add_argument("--out", required=True, metavar="DIR", default=argparse.SUPPRESS,
                   help="dataset directory to write (new, empty, or holding the same dataset)")
    p.add_argument("--tokenizer", choices=("char", "bpe"), default="char",
                   help="char: one token per distinct character; bpe: a byte-level BPE trained on the train split")
    p.add_argument("--vocab-size", type=int, default=argparse.SUPPRESS, metavar="N",
                   help=f"--tokenizer bpe: vocabulary size, 256..{MAX_VOCAB} (default {DEFAULT_BPE_VOCAB})")
    p.add_argument("--members", default=RECIPES["shakespeare"].members, metavar="GLOB",
                   help="for archives and recipes: the files to read, relative to the archive's top folder")
    p.add_argument("--vocab-from", default=None, metavar="DIR",
                   help="encode with the tokenizer of the dataset in DIR instead of making one, so that a model "
                        "trained on DIR can be fine-tuned on this text (train --init-from; docs/finetune.md)")
    p.add_argument("--tokenizer-from", default=None, metavar="DIR",
                   help="encode with the GPT-2 byte-level BPE of DIR/vocab.json + DIR/merges.txt (a Hugging Face "
                        "GPT-2 directory), for a model started with train --init-from DIR (docs/gpt2.md)")
    p.add_argument("--no-special-tokens", dest="special", action="store_false",
                   help="--tokenizer-from: read <|endoftext|> (and the directory's other special tokens) as ordinary "
                        "text, not as their one id each (docs/gpt2.md)")
    p.add_argument("--force", action="store_true",
                   help="replace another dataset in DIR, or write into a non-empty DIR that is not a dataset")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv, namespace=argparse.Namespace(vocab_size=None))
    start = time.perf_counter()
    try:
        if args.vocab_from is not None and (args.vocab_size is not None or args.tokenizer != "char"):
            raise PrepareError("--vocab-from takes the tokenizer of its dataset as it is: drop --tokenizer and "
                               "--vocab-size.")
        if args.tokenizer_from is not None and (args.vocab_from is not None or args.vocab_size is not None
                                                or args.tokenizer != "char"):
            raise PrepareError("--tokenizer-from takes the GPT-2 tokenizer of its directory as it is: drop "
                               "--vocab-from, --tokenizer and --vocab-size.")
        s = prepare(**vars(args))   # every flag is a parameter of prepare
        load_meta(args.out)                 # what we wrote must read back
    except ConfigError as exc:
        return fail(exc)
    asked = args.vocab_size or DEFAULT_BPE_VOCAB
    if s["kind"] == "bpe" and args.vocab_from is None and args.tokenizer_from is None and s["vocab_size"] < asked:
        print(f"note: --vocab-size {asked}{'' if args.vocab_size else ' (the default)'} was not reached: this text "
              f"gives {s['vocab_size']} tokens, the byte-level BPE found no more pairs to merge. The dataset's "
              f"vocabulary is {s['vocab_size']}; a longer text gives more.", file=sys.stderr)
    verb = {"unchanged": "unchanged (it already held this dataset)", "replace": "replaced"}.get(s["state"], "wrote")
    print(f"{args.out}: {verb}: {s['chars']} characters from {s['files']} file(s), {s['kind']} tokens, vocab "
          f"{s['vocab_size']}, train {s['train']} tokens, val {s['val']} tokens ({s['val_chars']} characters), "
          f"digest {s['digest'][:12]} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
