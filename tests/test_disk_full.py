"""A disk that fills during a save (a real, small tmpfs) fails fast and keeps the previous checkpoint."""

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from capstone.checkpoint import files

from conftest import mpi_env, mpirun, step_rows

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
    """The 600 KB disk holds one checkpoint: the save at step 20 hits ENOSPC mid-write (the
    free-space check is off, so HDF5 really writes). Every rank stops within seconds with one
    message, the partial file is gone and gives its space back, `latest` still names step 10.
    Asynchronous (the default): the write fails in the background thread, on every rank alike, and
    the run ends at the first step boundary where no rank's write still runs, well before the next
    save (step 30) would wait for it, with the same message; the metrics rows the full disk refused
    meanwhile are written once the partial file has given its space back."""
    with tmpfs(tmp_path / "disk") as disk:
        out = disk / "run"
        t0 = time.time()
        res = mpirun(2, "--out", out, "--steps", "40", "--ckpt-every", "10", mode, timeout=90,
                     env_extra={"CAPSTONE_CHECK_SPACE": "0"})
        elapsed = time.time() - t0
        assert res.returncode == 1, res.stderr
        assert res.stderr.count("of checkpoint step 20 to") == 1 and "MPI_ABORT" not in res.stderr
        assert "could not write" in res.stderr and "The partial file was removed" in res.stderr
        assert elapsed < 30, f"took {elapsed:.1f} s"
        logged = [r["step"] for r in step_rows(out)]
        assert logged == list(range(1, logged[-1] + 1)), "every step's row, none lost to the full disk"
        assert logged[-1] == 19 if mode == "--no-ckpt-async" else 20 <= logged[-1] < 28, logged[-1]
        ckpts = out / "checkpoints"
        assert sorted(os.listdir(ckpts)) == [files.final_name(10), files.final_name(10) + ".sha256", "latest"]
        assert files.read_pointer(str(ckpts)).endswith(files.final_name(10))
        assert verify(ckpts / files.final_name(10)).returncode == 0
        usage = shutil.disk_usage(disk)
        assert usage.used <= used_by_files(disk) + 8192, "the partial file's space was given back"


@ROOT_ONLY
def test_metrics_rows_a_full_disk_refuses_are_kept_and_written_when_space_returns(tmp_path, capsys):
    """metrics.jsonl on a real full disk (a checkpoint being written in the background fills it):
    the rows that do not fit are kept, one warning says so, and they are written, in order and
    whole, once the space is back; the run is not ended by its log."""
    from capstone.observe.report import MetricsLog
    with tmpfs(tmp_path / "disk", size="64k") as disk:
        log = MetricsLog(str(disk / "metrics.jsonl"))
        log.write({"step": 1, "loss": 1.0})
        filler = disk / "checkpoint.partial"
        with open(filler, "wb") as f, pytest.raises(OSError):
            f.write(b"x" * 128 * 1024)   # fills the disk, as a checkpoint's write does
            f.flush()
        for step in range(2, 40):
            log.write({"step": step, "loss": 1.0 / step, "pad": "y" * 100})
        assert capsys.readouterr().err.count("could not write") == 1
        assert len(log.pending) > 0
        filler.unlink()                  # the partial file removed: the space is back
        log.write({"step": 40, "loss": 0.025})
        log.close()
        assert step_rows(disk, "step") == list(range(1, 41))
        assert capsys.readouterr().err == ""
