"""Damaged checkpoints on disk (issue 9: items 11, 12, 13, 16), with real byte flips in a real
checkpoint: every reader refuses them with "not a valid checkpoint: FILE: reason" (never a crash
or a raw HDF5 error), `--resume auto` falls back past them and sets them aside, and the tools
accept a run directory or a `latest` pointer.

The CLI runs in a forked child per call (`cli`), so ~300 flips take seconds; a handful of real
`python -m capstone.checkpoint` and `mpirun` runs check the same end to end.
"""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

import h5py
import pytest

from capstone.checkpoint import files, integrity, resume
from capstone.checkpoint.__main__ import main as checkpoint_main

from conftest import ROOT, mpi_env, mpirun, summary

CLEAN = "not a valid checkpoint"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 2-rank run with checkpoints at steps 2 and 4 (latest names step 4). Copy, don't edit."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    res = mpirun(2, "--out", out, "--steps", "4", "--ckpt-every", "2")
    assert res.returncode == 0, res.stderr
    return out


def copy_run(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "checkpoints"


def cli(*argv):
    """`python -m capstone.checkpoint ARGV` in a forked child: (exit code, negative for a signal;
    stdout; stderr)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 3
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                code = checkpoint_main([str(a) for a in argv])
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read(), err.read()


def data_regions(path):
    with h5py.File(path, "r") as f:
        shards = [f["shards"][name] for name in sorted(f["shards"])]
        return [(ds.id.get_offset(), ds.id.get_storage_size()) for ds in shards]


def attribute_value_offset(path, name="offset", value=None):
    """File offset of the int64 value of attribute `name` equal to `value` (found after its name)."""
    raw = open(path, "rb").read()
    for m in re.finditer(re.escape(name.encode()) + b"\x00", raw):
        j = raw.find(struct.pack("<q", value), m.start(), m.start() + 80)
        if j >= 0:
            return j
    raise AssertionError(f"attribute {name}={value} not found in {path}")


def flip(path, offset, mask=0xFF):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def metadata_offsets(path, sample=150):
    """Every byte of the superblock and root group entry (96 bytes of a version-0 superblock) and
    `sample` offsets spread over the rest of the file outside the shard datasets' data."""
    regions = data_regions(path)
    outside = [o for o in range(96, os.path.getsize(path)) if not any(a <= o < a + n for a, n in regions)]
    return list(range(96)) + outside[::max(1, len(outside) // sample)]


def assert_clean(code, out, err, path):
    assert code == 1, (code, out, err)
    assert f"{CLEAN}: {path}" in out + err and "Traceback" not in out + err and "HDF5-DIAG" not in out + err


# --- item 12: corrupted files never crash a reader -------------------------------------------------


def test_flipped_metadata_bytes_are_refused_by_verify_and_inspect(run, tmp_path):
    src = run / "checkpoints" / files.final_name(2)
    offsets = metadata_offsets(src) + [attribute_value_offset(src, "offset", 15072)]
    work = tmp_path / files.final_name(2)
    shutil.copy(src.parent / (src.name + ".sha256"), str(work) + ".sha256")
    original = src.read_bytes()
    assert len(offsets) > 200
    for i, offset in enumerate(offsets):
        work.write_bytes(original)
        flip(work, offset)
        assert_clean(*cli("verify", work), work)
        if i % 10 == 0:
            assert_clean(*cli("inspect", work), work)
            code, out, err = cli("inspect", "--json", work)
            assert code == 1 and json.loads(out)["verified"] is False and CLEAN in json.loads(out)["error"]
    for offset in offsets[::100]:  # the real command, end to end
        work.write_bytes(original)
        flip(work, offset)
        res = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", str(work)],
                             capture_output=True, text=True, env=mpi_env(), cwd=ROOT)
        assert_clean(res.returncode, res.stdout, res.stderr, work)


def test_flipped_dataset_attribute_is_caught_even_with_a_rewritten_digest_file(run, tmp_path):
    """The `offset` attribute of /shards/rank00001 (15072 -> 15073) is compared with /meta_json."""
    _, ckpts = copy_run(run, tmp_path)
    path = ckpts / files.final_name(2)
    flip(path, attribute_value_offset(path, "offset", 15072), 0x01)
    assert_clean(*cli("verify", path), path)
    integrity.write_digest(str(path))  # as if damaged before it was hashed
    code, out, err = cli("verify", path)
    assert code == 1 and "BAD /shards/rank00001: " in out
    assert "attribute offset=15073 of /shards/rank00001 disagrees with the verified /meta_json" in out


def test_resume_refuses_flipped_metadata_cleanly_on_every_rank(run, tmp_path):
    out, ckpts = copy_run(run, tmp_path)
    path = ckpts / files.final_name(4)
    original = path.read_bytes()
    for offset in (44, original.find(b"TREE"), original.find(b"HEAP") + 8, original.find(b"SNOD"),
                   attribute_value_offset(path, "offset", 15072)):  # EOF address, B-tree, heap, group node
        path.write_bytes(original)
        flip(path, offset)
        res = mpirun(2, "--out", out, "--steps", "6", "--resume", "latest", timeout=60)
        assert res.returncode == 1, (offset, res.stderr)
        assert res.stderr.count(CLEAN) == 1 and str(path) in res.stderr and "--resume auto" in res.stderr
        assert "Traceback" not in res.stderr and "signal" not in res.stderr.lower()


def test_checkpoint_without_digest_file_is_refused_and_seal_adds_one(run, tmp_path):
    """An older capstone wrote no digest file: refused (HDF5 would parse unverified bytes), and
    `seal` adds one only after `verify --unsealed` passed in a child process."""
    _, ckpts = copy_run(run, tmp_path)
    good, bad = ckpts / files.final_name(2), ckpts / files.final_name(4)
    for p in (good, bad):
        os.remove(str(p) + ".sha256")
    code, out, err = cli("verify", good)
    assert code == 1 and "no digest file ckpt-00000002.h5.sha256" in err and "capstone.checkpoint seal" in err
    flip(bad, data_regions(bad)[1][0] + 7)
    code, out, err = cli("seal", bad)
    assert code == 1 and "not sealing" in err and not os.path.exists(str(bad) + ".sha256")
    assert cli("seal", good)[0] == 0 and cli("verify", good)[0] == 0
    assert cli("seal", good)[1].endswith("already sealed: its digest file " + str(good) + ".sha256 matches\n")


# --- item 11: --resume auto past a corrupt latest ---------------------------------------------------


def test_resume_auto_falls_back_past_a_corrupt_latest_and_sets_it_aside(run, tmp_path):
    out, ckpts = copy_run(run, tmp_path)
    latest = ckpts / files.final_name(4)
    flip(latest, 200)  # HDF5 metadata
    damaged = latest.read_bytes()
    res = mpirun(2, "--out", out, "--steps", "6", "--resume", "latest", timeout=60)
    assert res.returncode == 1 and res.stderr.count(f"{CLEAN}: {latest}") == 1 and "--resume auto" in res.stderr
    assert latest.read_bytes() == damaged, "--resume latest changes nothing"
    res = mpirun(2, "--out", out, "--steps", "6", "--resume", "auto", timeout=90)
    assert res.returncode == 0, res.stderr
    warning = [line for line in res.stderr.splitlines() if "--resume auto" in line]
    assert len(warning) == 1 and "set aside ckpt-00000004.h5 as ckpt-00000004.h5.corrupt-" in warning[0]
    assert "resuming from ckpt-00000002.h5" in warning[0]
    s = summary(out)
    assert s["resumed_from"].endswith(files.final_name(2)) and s["start_step"] == 2 and s["final_step"] == 6
    aside = [p for p in os.listdir(ckpts) if p.startswith("ckpt-00000004.h5.corrupt-")]
    assert len(aside) == 2 and (ckpts / sorted(aside)[0]).read_bytes() == damaged  # and its .sha256
    res = mpirun(2, "--out", out, "--steps", "8", "--resume", "auto", timeout=90)  # the requeue
    assert res.returncode == 0 and "--resume auto" not in res.stderr, res.stderr
    assert summary(out)["start_step"] == 6


def _state(ckpts):
    return {p.name: p.read_bytes() for p in ckpts.iterdir()}


def test_auto_plan_sets_aside_only_when_a_checkpoint_verifies(run, tmp_path):
    """Rank 0's decision, on each kind of damage: a corrupt newest (bytes, or a shard damaged
    before hashing) is set aside and `latest` moves; a missing digest file, or no checkpoint
    that verifies, stops with an error and changes nothing."""
    _, ckpts = copy_run(run, tmp_path)
    newest, older = ckpts / files.final_name(4), ckpts / files.final_name(2)
    flip(newest, data_regions(newest)[0][0] + 3)
    integrity.write_digest(str(newest))  # damaged before it was hashed: only the shard digest knows
    flip(older, 100)
    before = _state(ckpts)
    plan = resume._plan("auto", str(ckpts))
    assert "no checkpoint in" in plan["error"] and plan["invalid"] and _state(ckpts) == before
    flip(older, 100)  # undo
    os.rename(str(older) + ".sha256", str(older) + ".saved")
    before = _state(ckpts)
    plan = resume._plan("auto", str(ckpts))
    assert "no digest file" in plan["error"] and "seal" in plan["error"] and _state(ckpts) == before
    os.rename(str(older) + ".saved", str(older) + ".sha256")
    plan = resume._plan("auto", str(ckpts))
    assert plan["path"] == str(older) and "\n" not in plan["warning"] and "/shards/rank00000 sha256" in plan["warning"]
    assert files.read_pointer(str(ckpts)) == str(older) and not newest.exists()
    assert len([p for p in os.listdir(ckpts) if ".corrupt-" in p]) == 2
    assert resume._plan("auto", str(ckpts)) == {"path": str(older)}


# --- item 13: inspect --json ------------------------------------------------------------------------


def test_inspect_json_prints_only_json(run, tmp_path):
    path = run / "checkpoints" / files.final_name(4)
    res = subprocess.run([sys.executable, "-m", "capstone.checkpoint", "inspect", "--json", str(path)],
                         capture_output=True, text=True, env=mpi_env(), cwd=ROOT)
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and doc["verified"] is True and doc["problems"] == [] and doc["step"] == 4
    assert doc["file"] == str(path) and "verified" in res.stderr
    _, ckpts = copy_run(run, tmp_path)
    flip(ckpts / files.final_name(4), 5000)
    code, out, err = cli("inspect", "--json", ckpts)
    assert code == 1 and json.loads(out)["verified"] is False and err.startswith(f"error: {CLEAN}")


# --- item 16: a run directory or `latest` ---------------------------------------------------------


def test_tools_and_resume_accept_a_run_directory_or_latest(run, tmp_path):
    want = str(run / "checkpoints" / files.final_name(4))
    for target in (run, run / "checkpoints", run / "checkpoints" / "latest"):
        for command in ("verify", "inspect"):
            code, out, err = cli(command, target)
            assert code == 0 and f"{want}: verified" in out, (target, command, out, err)
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in ("verify", "inspect", "seal"):   # names no checkpoint: a usage mistake, 2, as sample
        code, out, err = cli(command, empty)
        assert code == 2 and "is a directory without checkpoints" in err and "errno" not in err.lower(), err
    for command in ("verify", "inspect", "seal"):   # a mistyped path is a usage mistake: 2, as sample and export
        code, out, err = cli(command, tmp_path / "missing.h5")
        assert code == 2 and f"{CLEAN}: {tmp_path / 'missing.h5'}: it does not exist" in err, (command, err)
    res = mpirun(2, "--out", tmp_path / "branch", "--steps", "6", "--resume", run, timeout=90)
    assert res.returncode == 0, res.stderr
    assert summary(tmp_path / "branch")["resumed_from"] == want
