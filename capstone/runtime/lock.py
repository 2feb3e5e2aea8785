"""One run per run directory: an exclusive lock on OUT/.lock, held by rank 0 for the whole run.

Why flock(2) and not a heartbeat file: the kernel drops the lock the moment the holding process
dies (Ctrl-C, kill -9, the OOM killer), so a killed job never leaves it stuck and no stale age
has to be guessed; a heartbeat needs a thread that rewrites the file and a timeout during which
a dead run still blocks its successor. The file also holds a JSON owner record (host, pid, the
launcher's pid, Slurm job id, start time, command) for the refusal message. It stays in place
after the run: deleting a lock file races with a process that has just opened it.

Filesystems: local disks and NFS work across nodes (Linux emulates flock on NFS as a whole-file
POSIX lock since 2.6.12: NFSv4, or NFSv3 with lockd; NOT with the `nolock` mount option, where a
lock is seen on its own node only). Lustre needs the `flock` mount option: with `localflock` the
lock is per node, without either flock fails with ENOSYS and the run goes on unlocked with a
warning. Check what your site's scratch filesystem does before running two jobs on one --out.
"""

import errno
import fcntl
import json
import os
import socket
import sys
import time

NAME = ".lock"
_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def describe(owner: dict) -> str:
    if not owner:
        return "a run that has not written its owner record yet (it is starting up)"
    job = f", Slurm job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    job += f", run {owner['run_id']}" if owner.get("run_id") else ""
    return (f"pid {owner.get('pid')} on host {owner.get('host')} (launched by pid {owner.get('launcher_pid')}"
            f"{job}), running since {owner.get('started')}: {owner.get('command')}")


def acquire(out: str) -> tuple["Held | None", str | None]:
    """Rank 0. Lock OUT/.lock for this process: (Held, None) when locked, (None, warning) when the
    filesystem has no locks; raises BlockingIOError with the owner's description when held."""
    path = os.path.join(out, NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        owner = _read(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise BlockingIOError(describe(owner)) from None
        if exc.errno in _UNSUPPORTED:
            return None, (f"warning: {path}: this filesystem does not support file locks ({exc.strerror}); "
                          f"running unlocked: make sure no other run uses this --out at the same time.")
        raise
    _write(fd, {"host": socket.gethostname(), "pid": os.getpid(), "launcher_pid": os.getppid(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)})
    return Held(fd), None


class Held:
    """The lock on OUT/.lock that this process holds (closing its descriptor releases it)."""

    def __init__(self, fd: int):
        self.fd: int | None = fd

    def label(self, **fields) -> None:
        """Add `fields` (the run's id, once it is known) to the owner record."""
        if self.fd is not None:
            _write(self.fd, {**_read(self.fd), **fields})

    def release(self) -> None:
        """Give the lock up early (a failed start); otherwise it goes with the process."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _write(fd: int, owner: dict) -> None:
    """Replace the owner record in the lock file `fd`."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner, sort_keys=True).encode() + b"\n", 0)


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
