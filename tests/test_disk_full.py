"""A disk that fills during a save (a real, small tmpfs) fails fast and keeps the previous checkpoint."""

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from capstone.checkpoint import files

from conftest import mpi_env, mpirun

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, setpriv)")


@contextmanager
def tmpfs(path, size="600k"):
    """A small filesystem of its own at `path`, unmounted whatever happens."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)]).returncode != 0:
            subprocess.run(["umount", "-l", str(path)])


def verify(path):
    return subprocess.run([sys.executable, "-m", "capstone.checkpoint", "verify", str(path)],
                          capture_output=True, text=True, env=mpi_env())


def used_by_files(disk) -> int:
    """The bytes tmpfs gives the files under `disk` (whole 4 KiB pages)."""
    return sum(-(-os.path.getsize(os.path.join(d, f)) // 4096) * 4096 for d, _, fs in os.walk(disk) for f in fs)


@ROOT_ONLY
@pytest.mark.parametrize("mode", ["--ckpt-async", "--no-ckpt-async"])
def test_disk_full_during_a_save_fails_fast_and_keeps_the_previous_checkpoint(tmp_path, mode):
    """The 600 KB disk holds one checkpoint: the save at step 10 hits ENOSPC mid-write (the
    free-space check is off, so HDF5 really writes). Every rank stops within seconds with one
    message, the partial file is gone and gives its space back, `latest` still names step 5.
    Asynchronous (the default): the write fails in the background thread, on every rank alike, and
    the run ends at the next wait for it (the save of step 15) with the same message."""
    with tmpfs(tmp_path / "disk") as disk:
        out = disk / "run"
        t0 = time.time()
        res = mpirun(2, "--out", out, "--ckpt-every", "5", mode, timeout=90, env_extra={"CAPSTONE_CHECK_SPACE": "0"})
        elapsed = time.time() - t0
        assert res.returncode == 1, res.stderr
        assert res.stderr.count("of checkpoint step 10 to") == 1 and "MPI_ABORT" not in res.stderr
        assert "could not write" in res.stderr and "The partial file was removed" in res.stderr
        assert elapsed < 30, f"took {elapsed:.1f} s"
        ckpts = out / "checkpoints"
        assert sorted(os.listdir(ckpts)) == [files.final_name(5), files.final_name(5) + ".sha256", "latest"]
        assert files.read_pointer(str(ckpts)).endswith(files.final_name(5))
        assert verify(ckpts / files.final_name(5)).returncode == 0
        usage = shutil.disk_usage(disk)
        assert usage.used <= used_by_files(disk) + 8192, "the partial file's space was given back"
