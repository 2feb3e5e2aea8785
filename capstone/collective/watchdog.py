"""A rank's watchdog for the calls that cannot be made non-blocking (capstone.collective.deadline.guard).

A thread would not do: h5py holds the GIL while HDF5 waits in MPI-IO, so no Python thread could
run. So the watchdog is a small process, started on first use: `Watchdog` (the rank's side) runs
`python -I -S watchdog.py PARENT_PID`, which reads JSON orders from its stdin, one per line:

  {"arm": SECONDS, "line": TEXT, "record": PATH or null, "data": {...}}   start the clock
  {"disarm": true}                                                         stop it

When an armed clock runs out it prints TEXT to stderr, writes `data` as JSON to PATH and kills the
parent with SIGKILL (the launcher then ends the job). It exits when its stdin closes (the parent
is gone). It stays in its parent's process group, so Ctrl-Z stops it with the rank, and it ignores
the signals the launcher forwards as stop requests (SIGINT, SIGTERM, SIGUSR1), which the rank
itself handles. Standard library only, so it starts in milliseconds and needs nothing of the parent's.
"""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time


class Watchdog:
    """The rank's side: the watchdog process (started on first use), armed and disarmed by `send`."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def send(self, order: dict) -> None:
        """Send one order (see the module: {"arm": SECONDS, ...} or {"disarm": true})."""
        line = json.dumps(order).encode() + b"\n"
        for _ in range(2):   # a watchdog killed from outside is replaced once
            if self.proc is None or self.proc.poll() is not None:
                self.proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid())],
                                             stdin=subprocess.PIPE, close_fds=True)
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
                return
            except OSError:
                self.proc = None


def write_record(path: str | None, data: dict) -> None:
    """Write `data` as JSON to `path` by rename, best effort (the run directory may be unwritable or gone)."""
    if path:
        with contextlib.suppress(OSError):
            with open(tmp := f"{path}.tmp-{os.getpid()}", "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)


def expire(parent: int, order: dict) -> None:
    os.write(2, (order["line"] + "\n").encode())
    write_record(order.get("record"), order["data"])
    os.kill(parent, signal.SIGKILL)


def main(parent: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    armed, until, pending = None, None, b""
    while True:
        if not select.select([0], [], [], None if until is None else max(0.0, until - time.monotonic()))[0]:
            expire(parent, armed)
            return
        if not (chunk := os.read(0, 1 << 16)):
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            order = json.loads(line)
            armed, until = (order, time.monotonic() + order["arm"]) if "arm" in order else (None, None)


if __name__ == "__main__":
    main(int(sys.argv[1]))
