"""Where a run came from: command line, code version, library versions, hosts.

`collect(comm)` is collective: rank 0 asks git (once, with a timeout) and reads the versions, every
rank contributes its host name, and every rank gets rank 0's record (so a checkpoint's metadata,
which all ranks hash, is the same everywhere). It goes into the start row of metrics.jsonl,
summary.json and every checkpoint's metadata. Anything that cannot be found is null.
"""

import contextlib
import os
import platform
import socket
import subprocess
import sys

GIT_TIMEOUT = 5.0  # seconds per git call
CODE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout holding capstone/


def _git(*args: str, cwd: str = CODE_DIR) -> str | None:
    """stdout of `git ARGS` in the code's directory, or None (no git, not a repository, timeout)."""
    try:
        res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def git_info(cwd: str = CODE_DIR) -> dict:
    """{"commit": sha or None, "dirty": bool or None}: dirty means tracked files differ from the
    commit (staged or not); untracked files do not count (like `git describe --dirty`)."""
    commit = _git("rev-parse", "HEAD", cwd=cwd)
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd) if commit else None
    return {"commit": commit.strip() if commit else None, "dirty": None if status is None else bool(status.strip())}


def _version(module: str) -> str | None:
    """The installed distribution's version (autograd has no __version__), else the module's."""
    from importlib import metadata
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(module)
    with contextlib.suppress(Exception):   # an absent or broken package is recorded as null
        return getattr(__import__(module), "__version__", None)
    return None


def local() -> dict:
    """This process's record (without the other ranks' hosts)."""
    versions = {name: _version(name) for name in ("numpy", "mpi4py", "h5py", "autograd")}
    versions["python"] = platform.python_version()
    versions.update(dict.fromkeys(("mpi_library", "mpi_standard", "hdf5", "h5py_mpi")))   # null unless found
    with contextlib.suppress(Exception):
        from mpi4py import MPI
        versions["mpi_library"], versions["mpi_standard"] = (
            MPI.Get_library_version().replace("\0", "").strip().splitlines()[0], "%d.%d" % MPI.Get_version())
    with contextlib.suppress(Exception):
        import h5py
        versions["hdf5"], versions["h5py_mpi"] = h5py.version.hdf5_version, bool(h5py.get_config().mpi)
    return {"argv": list(sys.argv), "orig_argv": list(getattr(sys, "orig_argv", sys.argv)),
            "executable": sys.executable, "cwd": os.getcwd(), "git": git_info(), "versions": versions,
            "platform": platform.platform()}


def collect(comm) -> dict:
    """Collective: call on all ranks. Rank 0's record plus every rank's host name, on every rank."""
    hosts = comm.allgather_json(socket.gethostname())
    return {**comm.bcast_json(local() if comm.rank == 0 else None), "hosts": hosts}
