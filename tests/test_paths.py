"""The one path classifier (capstone.flags.paths, issue 48 item 4): each kind from a real layout on disk, the
partial cases, which kinds each command takes (a spec written out here: a command that takes a kind it
should refuse fails), and the refusal's words: what the path is and what the flag takes."""

import contextlib
import io
import json
import subprocess
import sys

import pytest

from conftest import ROOT

from capstone.flags import paths
from capstone.config import ConfigError
from capstone.flags.paths import Kind

K = Kind


def make(root) -> dict:
    """Kind -> a path of that kind, laid out under `root` as the commands leave them."""
    def write(rel, data=b""):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path
    ckpt = write("run/checkpoints/ckpt-00000002.h5", paths.HDF5_SIGNATURE + bytes(64))
    write("run/checkpoints/ckpt-00000002.h5.sha256", "# capstone checkpoint digest v1: 72 bytes\n")
    write("run/checkpoints/latest", "ckpt-00000002.h5\n")
    write("run/metrics.jsonl", '{"event": "start"}\n')
    write("hf/config.json", "{}")
    write("hf/model.safetensors", b"\x08" + bytes(7) + b"{}      ")
    write("half/config.json", "{}")
    write("bin/config.json", "{}")
    write("bin/pytorch_model.bin", b"\x80\x04a pickle")
    for name in ("meta.json", "train.bin", "val.bin"):
        write(f"ds/{name}", "{}" if name == "meta.json" else b"\0\0")
    (root / "empty").mkdir()
    return {K.MISSING: root / "nope", K.EMPTY: root / "empty", K.RUN: root / "run",
            K.CHECKPOINTS: root / "run" / "checkpoints", K.POINTER: root / "run" / "checkpoints" / "latest",
            K.CHECKPOINT: ckpt, K.EXPORT: write("x.safetensors", b"\x08" + bytes(15)), K.HF_MODEL: root / "hf",
            K.HF_HALF: root / "half", K.HF_PICKLE: root / "bin", K.DATASET: root / "ds",
            K.TEXT: write("story.txt", "once upon a time é\n" * 3), K.DIRECTORY: write("notes/todo.txt", "x").parent,
            K.FILE: write("blob", b"\x00\xff\xfe binary")}


@pytest.fixture
def layout(tmp_path):
    return make(tmp_path)


def test_every_kind_from_a_real_layout(layout):
    assert set(layout) == set(Kind)
    assert {k: paths.kind(str(p)) for k, p in layout.items()} == {k: k for k in layout}


def test_the_partial_and_borderline_cases(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"x")          # model.safetensors alone
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text("{}")                    # config.json alone
    assert paths.kind(str(tmp_path / "weights")) is K.HF_HALF is paths.kind(str(tmp_path / "config"))
    assert "model.safetensors found but config.json missing" in paths.describe(str(tmp_path / "weights"))
    assert "config.json found but model.safetensors missing" in paths.describe(str(tmp_path / "config"))
    (tmp_path / "logged").mkdir()
    (tmp_path / "logged" / "summary.json").write_text("{}")                   # a run that saved no checkpoint
    assert paths.kind(str(tmp_path / "logged")) is K.RUN
    (tmp_path / "writing").mkdir()                                            # a prepare killed mid-write
    (tmp_path / "writing" / "train.bin").write_bytes(b"\0\0")
    (tmp_path / "writing" / ".val.bin.123.ab.tmp").write_bytes(b"\0")
    assert paths.kind(str(tmp_path / "writing")) is K.DATASET
    (tmp_path / "copy.h5").write_bytes(b"not hdf5")                           # a checkpoint by its name,
    (tmp_path / "moved").write_bytes(paths.HDF5_SIGNATURE)                    # its signature,
    (tmp_path / "sealed").write_bytes(b"damaged")                             # or its digest file
    (tmp_path / "sealed.sha256").write_text("x")
    assert {paths.kind(str(tmp_path / n)) for n in ("copy.h5", "moved", "sealed")} == {K.CHECKPOINT}
    cut = ("é" * 2048).encode()[:paths.HEAD_BYTES + 1]                        # a character cut at the 4 KiB mark
    (tmp_path / "long.txt").write_bytes(cut)
    (tmp_path / "nul.txt").write_bytes(b"text\0")
    (tmp_path / "void").write_bytes(b"")
    assert [paths.kind(str(tmp_path / n)) for n in ("long.txt", "nul.txt", "void")] == [K.TEXT, K.FILE, K.FILE]


CHECKPOINTS = {K.RUN, K.CHECKPOINTS, K.POINTER, K.CHECKPOINT}
DIRECTORIES = {K.EMPTY, K.RUN, K.CHECKPOINTS, K.HF_MODEL, K.HF_HALF, K.HF_PICKLE, K.DATASET, K.DIRECTORY}
# the spec: what each command takes; any other kind must be refused before anything reads it
SPEC = {
    "--init-from": CHECKPOINTS | {K.EXPORT, K.HF_MODEL},
    "--resume": CHECKPOINTS,
    "export": CHECKPOINTS,
    "sample": CHECKPOINTS,
    "checkpoint": CHECKPOINTS | {K.TEXT, K.FILE, K.EMPTY, K.DIRECTORY},   # verify says why it is no checkpoint
    "--data": {K.DATASET, K.EMPTY},            # empty: a prepare that wrote nothing yet (meta.json: missing)
    "--vocab-from": {K.DATASET, K.EMPTY},
    "--tokenizer-from": {K.HF_MODEL, K.HF_HALF, K.HF_PICKLE, K.DIRECTORY},   # it looks for vocab.json + merges.txt
    "prepare --out": DIRECTORIES | {K.MISSING},
    "export --out": {K.MISSING, K.EXPORT, K.TEXT, K.FILE},                # never over a checkpoint
    "export --out --format hf": {K.MISSING, K.EMPTY, K.HF_MODEL, K.HF_HALF, K.HF_PICKLE, K.DIRECTORY},
}


def test_no_command_takes_a_kind_it_should_refuse(layout):
    """The table is the spec, and refuse() follows the table on real paths: each command takes its kinds
    and refuses every other one with a ConfigError naming the path, what it is and what the flag takes."""
    assert {flag: set(takes.kinds) for flag, takes in paths.ACCEPTS.items()} == SPEC
    for flag, kinds in SPEC.items():
        takes = paths.ACCEPTS[flag]
        for found, path in layout.items():
            if found in kinds:
                assert paths.refuse(flag, str(path)) is found
                continue
            with pytest.raises(ConfigError) as exc:
                paths.refuse(flag, str(path))
            said = str(exc.value)
            assert str(path) in said and f"{takes.name or flag} takes {takes.long}." in said, (flag, found, said)
            assert (takes.missing if found is K.MISSING else f"is {paths.describe(str(path), found)}") in said
            assert "\n" not in said, said


def said_by(flag: str, path: str, tmp_path) -> str:
    """What the command that takes `flag` says of `path`, called as it is run (its error's text; "" if none)."""
    from capstone import export, prepare, sample
    from capstone.gpt2 import finetune, hf
    from capstone.checkpoint import __main__ as tool, resume
    from capstone.data.dataset import load_meta
    calls = {"--init-from": lambda: finetune.read(path), "--resume": lambda: resume._plan(path, str(tmp_path / "c")),
             "export": lambda: export._load(path), "sample": lambda: sample.resolve(path),
             "--data": lambda: load_meta(path), "--vocab-from": lambda: load_meta(path, "--vocab-from"),
             "--tokenizer-from": lambda: hf.gpt2_tokenizer(path),
             "prepare --out": lambda: prepare.prepare([str(tmp_path / "none.txt")], path),
             "export --out": lambda: export.check_out(path, "safetensors", False),
             "export --out --format hf": lambda: export.check_out(path, "hf", False)}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = tool.main(["verify", path]) if flag == "checkpoint" else calls[flag]()
    except Exception as exc:   # noqa: BLE001 - each command's own error class
        return str(exc)
    return err.getvalue() if code == 2 else ""


def test_every_command_refuses_through_the_table(layout, tmp_path):
    """Each command asks capstone.flags.paths before it reads anything: a kind it does not take is refused with the
    table's message, whatever the command (a command that took one it should refuse would say something else)."""
    for flag, kinds in SPEC.items():
        for found in set(Kind) - kinds:
            path = str(layout[found])
            assert paths.message(flag, path, found) in said_by(flag, path, tmp_path), (flag, found)


def test_the_refusals_keep_their_advice(layout):
    said = {(flag, k): paths.message(flag, str(layout[k]), k) for flag in SPEC for k in Kind}
    assert "--init-from" in said["sample", K.EXPORT] and "is a model's weights" in said["export", K.HF_MODEL]
    assert "pytorch_model.bin, a pickle" in said["--init-from", K.HF_PICKLE]
    assert "save_pretrained" in said["--init-from", K.HF_PICKLE]
    assert "config.json found but model.safetensors missing" in said["--init-from", K.HF_HALF]
    assert f"--vocab-from {layout[K.DATASET]}" in said["--tokenizer-from", K.DATASET]
    story = said["--data", K.TEXT]
    assert f"`python -m capstone.prepare {layout[K.TEXT]} --out " in story and "is a file" in story
    assert f"not a valid checkpoint: {layout[K.MISSING]}: it does not exist" in said["checkpoint", K.MISSING]
    (layout[K.RUN] / "summary.json").write_text(json.dumps({"train_config": {"data": "data/shk"}}))
    assert "That run trained on --data data/shk." in paths.message("--data", str(layout[K.RUN]), K.RUN)


def test_the_classifier_is_cheap_to_import():
    """Standard library and capstone.config only: any command may classify before it imports numpy."""
    res = subprocess.run([sys.executable, "-c", "import sys, capstone.flags.paths; print(sorted(m for m in sys.modules "
                          "if m.split('.')[0] in ('capstone', 'numpy', 'h5py', 'safetensors')))"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 0 and res.stdout.split() == ["['capstone',", "'capstone.config',", "'capstone.flags',",
                                                 "'capstone.flags.paths']"], \
        res.stdout + res.stderr
