"""What a path named on a command line is (`kind`), and the refusal of one a flag does not take (`refuse`).

Every path a user names (--init-from, --resume, --data, --vocab-from, --tokenizer-from, an --out, the
TARGET of `python -m capstone.export|sample|checkpoint`) is classified here, once, from its names and
a file's first bytes: nothing there, a run directory, a checkpoints directory, a `latest` pointer, a
checkpoint file, a .safetensors file, a Hugging Face model directory (whole, half of one, or one whose
weights are a pickle), a prepared dataset, a text file, another directory or file. ACCEPTS says which
kinds each flag takes; any other is refused with one message that says what the path is, what the
flag takes and, where there is more to say (ADVICE), what to do instead. What is inside an accepted
path (a checkpoint's digests, a dataset's meta.json, a model's tensors) is its reader's to check.
Standard library only, so any module may ask.
"""

import codecs
import contextlib
import enum
import json
import os
import re
from dataclasses import dataclass, replace

from capstone.config import ConfigError

POINTER = "latest"                                   # a checkpoints directory's pointer file
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8})\.h5$")
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"                 # at byte 0 of every file h5py writes (no user block)
DIGEST_SUFFIX = ".sha256"                            # a checkpoint's digest file: ckpt-*.h5.sha256
HF_FILES = ("config.json", "model.safetensors")      # a Hugging Face model directory (save_pretrained)
PICKLE_WEIGHTS = "pytorch_model.bin"                    # an older hub model's weights: a pickle, never read
META_FILE = "meta.json"
DATASET_FILES = (META_FILE, "train.bin", "val.bin", "tokenizer.json")   # what `capstone.prepare` writes
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json")           # what a training run's --out holds
HEAD_BYTES = 4096


class Kind(enum.Enum):
    """What a path is; the value says it in words, as in "--data X is <value>"."""

    MISSING = "nothing"
    EMPTY = "a directory (an empty one)"
    RUN = "a training run's directory"
    CHECKPOINTS = "a checkpoints directory"
    POINTER = "a `latest` pointer"
    CHECKPOINT = "a checkpoint file"
    EXPORT = "a model's weights (a .safetensors file)"
    HF_MODEL = "a model's weights (a Hugging Face model directory)"
    HF_HALF = "an incomplete Hugging Face model directory"
    HF_PICKLE = "a model directory whose weights are pytorch_model.bin, a pickle"
    DATASET = "a prepared dataset"
    TEXT = "a file of text"
    DIRECTORY = "a directory"
    FILE = "a file"


def dataset_file(name: str) -> bool:
    """A file `capstone.prepare` writes, or the temp file of one (an interrupted prepare leaves those)."""
    return name in DATASET_FILES or (name.endswith(".tmp") and any(name.startswith(f".{f}.") for f in DATASET_FILES))


def kind(path: str) -> Kind:
    """What `path` is (see Kind): from its entries if a directory, its name and first bytes if a file."""
    if not os.path.exists(path):
        return Kind.MISSING
    return _directory(path) if os.path.isdir(path) else _file(path)


def _directory(path: str) -> Kind:
    try:
        names = set(os.listdir(path))
    except OSError:
        return Kind.DIRECTORY
    config, weights = (os.path.isfile(os.path.join(path, n)) for n in HF_FILES)
    if config and weights:
        return Kind.HF_MODEL
    if config and os.path.isfile(os.path.join(path, PICKLE_WEIGHTS)):
        return Kind.HF_PICKLE
    if config or weights:
        return Kind.HF_HALF
    if META_FILE in names:   # a dataset (written beside a run's files only with prepare --force)
        return Kind.DATASET
    if os.path.isdir(os.path.join(path, RUN_FILES[0])) or names & set(RUN_FILES[1:]):
        return Kind.RUN
    if POINTER in names or any(CHECKPOINT_NAME.match(n) for n in names):
        return Kind.CHECKPOINTS
    if names and all(map(dataset_file, names)):   # a dataset being written (an interrupted prepare)
        return Kind.DATASET
    return Kind.DIRECTORY if names else Kind.EMPTY


def _file(path: str) -> Kind:
    name = os.path.basename(path)
    if name == POINTER:
        return Kind.POINTER
    if name.endswith(".safetensors"):
        return Kind.EXPORT
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return Kind.FILE
    if name.endswith(".h5") or head.startswith(HDF5_SIGNATURE) or os.path.exists(path + DIGEST_SUFFIX):
        return Kind.CHECKPOINT
    return Kind.TEXT if _text(head) else Kind.FILE


def _text(head: bytes) -> bool:
    """Whether a file's first bytes are text: UTF-8 (a character cut at the end allowed), no NUL byte."""
    with contextlib.suppress(UnicodeDecodeError):
        codecs.getincrementaldecoder("utf-8")().decode(head)
        return bool(head) and b"\0" not in head
    return False


def describe(path: str, found: Kind | None = None) -> str:
    """`found` (default: `kind(path)`) in words, with what a directory holds where that tells more."""
    found = found or kind(path)
    if found is Kind.DIRECTORY:
        with contextlib.suppress(OSError):   # unreadable: just "a directory"
            names = sorted(os.listdir(path))
            return f"a directory holding {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
    if found is Kind.HF_HALF:
        there = os.path.isfile(os.path.join(path, HF_FILES[0]))
        return f"{found.value} ({HF_FILES[1 - there]} found but {HF_FILES[there]} missing)"
    return found.value


@dataclass(frozen=True)
class Takes:
    """What a flag takes: its kinds, and in words, briefly (`short`) and whole (`long`)."""

    kinds: frozenset
    short: str
    long: str
    name: str = ""                              # who takes it, in the message ("" : the flag)
    subject: str = "{flag} {path}"              # how the message names the path
    missing: str = "no such file or directory"  # what it says of a path that is not there


K = Kind
CHECKPOINT_KINDS = frozenset({K.RUN, K.CHECKPOINTS, K.POINTER, K.CHECKPOINT})
DIRECTORY_KINDS = frozenset({K.EMPTY, K.RUN, K.CHECKPOINTS, K.HF_MODEL, K.HF_HALF, K.HF_PICKLE, K.DATASET, K.DIRECTORY})
RESUME = Takes(CHECKPOINT_KINDS, "a run directory or checkpoint", "a run directory (--out of a training run), its "
               "checkpoints directory or `latest` pointer, or a ckpt-*.h5 file")
PREPARED = "the directory `python -m capstone.prepare TEXT_FILE... --out DIR` wrote"
OUT = {"name": "--out", "subject": "--out {path}"}   # a command's --out
ACCEPTS = {
    "--init-from": Takes(CHECKPOINT_KINDS | {K.EXPORT, K.HF_MODEL},
                         "a run directory, checkpoint, .safetensors export or Hugging Face model directory",
                         "a run directory (its checkpoints/latest), a ckpt-*.h5 file, a .safetensors file `python -m "
                         "capstone.export` wrote, or a Hugging Face GPT-2 directory (config.json + model.safetensors)"),
    "--resume": RESUME,
    **{tool: replace(RESUME, name=f"python -m capstone.{tool}", subject="{path}") for tool in ("export", "sample")},
    # verify looks at any other file or directory too, and says why it is no checkpoint (integrity)
    "checkpoint": replace(RESUME, kinds=RESUME.kinds | {K.TEXT, K.FILE, K.EMPTY, K.DIRECTORY}, name="python -m "
                          "capstone.checkpoint", subject="not a valid checkpoint: {path}", missing="it does not exist"),
    # an empty directory is a prepare that wrote nothing yet: load_meta says meta.json is missing
    **dict.fromkeys(("--data", "--vocab-from"), Takes(frozenset({K.DATASET, K.EMPTY}), "a prepared dataset", PREPARED,
                                                      missing="no such directory")),
    "--tokenizer-from": Takes(frozenset({K.HF_MODEL, K.HF_HALF, K.HF_PICKLE, K.DIRECTORY}),
                              "a directory holding the GPT-2 tokenizer (vocab.json + merges.txt)",
                              "a Hugging Face GPT-2 directory holding its tokenizer's vocab.json and merges.txt (as "
                              "GPT2Tokenizer.save_pretrained writes them)", missing="no such directory"),
    "prepare --out": Takes(DIRECTORY_KINDS | {K.MISSING}, "a directory",
                           "a new or empty directory, or one holding a dataset (--force: any directory)", **OUT),
    "export --out": Takes(frozenset({K.MISSING, K.EXPORT, K.TEXT, K.FILE}), "a .safetensors file name",
                          "the .safetensors file to write (an existing one is replaced only with --force)", **OUT),
    "export --out --format hf": Takes(frozenset({K.MISSING, K.EMPTY, K.HF_MODEL, K.HF_HALF, K.HF_PICKLE, K.DIRECTORY}),
                                      "a new directory or a Hugging Face model's",
                                      "a directory with --format hf: the Hugging Face model directory to write (an "
                                      "existing model is replaced only with --force)", **OUT),
}
READERS = ("--init-from", "--resume", "export", "sample", "checkpoint")
ADVICE_ROWS = (
    (READERS, (K.EXPORT, K.HF_MODEL), "Fine-tune it into a run (python -m capstone.train --init-from {path} ... --out "
                                      "RUN_DIR) and pass RUN_DIR, or load it with transformers "
                                      "(GPT2LMHeadModel.from_pretrained; docs/export.md)."),
    (("--init-from",), (K.HF_HALF,), "A Hugging Face model directory needs both files, as save_pretrained writes them "
                                     "(a sharded model is not read): export it again (python -m capstone.export "
                                     "RUN_DIR --out {path} --format hf --force) or copy the missing file."),
    (("--init-from",), (K.HF_PICKLE,), "capstone does not read a pickle: write model.safetensors beside it in a "
                                       "Python with transformers: GPT2LMHeadModel.from_pretrained('{path}')"
                                       ".save_pretrained('{path}')."),
    (("--data", "--vocab-from"), (K.MISSING,), "To make one there: `python -m capstone.prepare TEXT_FILE... --out "
                                               "{path}`."),
    (("--data", "--vocab-from"), (K.TEXT,), "Prepare a dataset from it first: `python -m capstone.prepare {path} "
                                            "--out {prepared}`, then pass {flag} {prepared}."),
    (("--data", "--vocab-from"), (K.RUN,), "{run_data}"),
    (("--tokenizer-from",), (K.DATASET,), "To encode with that dataset's tokenizer, pass --vocab-from {path} instead."),
    (("export --out",), DIRECTORY_KINDS, "Pass a file name such as {inside}, or --format hf to write a Hugging Face "
                                         "model directory."),
)
ADVICE = {(flag, k): text for flags, kinds, text in ADVICE_ROWS for flag in flags for k in kinds}


def refuse(flag: str, path: str, error=ConfigError) -> Kind:
    """The kind of `path` if `flag` takes it (ACCEPTS[flag]); else raise `error` (a ConfigError class, or
    any callable of the message) saying what the path is and what the flag takes."""
    if (found := kind(path)) in ACCEPTS[flag].kinds:
        return found
    raise error(message(flag, path, found))


def message(flag: str, path: str, found: Kind) -> str:
    """The refusal of `path` (of kind `found`) given to `flag`: one paragraph."""
    takes = ACCEPTS[flag]
    subject = takes.subject.format(flag=flag, path=path)
    head = (f"{subject}: {takes.missing}" if found is Kind.MISSING else
            f"{subject} is {describe(path, found)}, not {takes.short}")
    advice = ADVICE.get((flag, found), "").format(flag=flag, path=path, prepared=_prepared(path),
                                                  inside=os.path.join(path.rstrip("/"), HF_FILES[1]),
                                                  run_data=_run_data(path) if found is Kind.RUN else "")
    return f"{head}. {advice}{' ' if advice else ''}{takes.name or flag} takes {takes.long}."


def _prepared(path: str) -> str:
    """Where a dataset of the text file `path` would go: beside it, named after it (story.txt: story-data)."""
    root = os.path.splitext(path)[0]
    return (root[:-4] if root.endswith(".tar") else root) + "-data"


def _run_data(path: str) -> str:
    """What the run in `path` trained on, from its summary.json, when it says."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError), open(os.path.join(path, "summary.json")) as f:
        data = json.load(f)["train_config"]["data"]
        return f"That run trained on --data {data}." if data else "That run trained on the synthetic corpus."
    return ""
