"""The watchdog process of one rank (capstone.parallel.deadline.Deadline.guard): `python -I -S
watchdog.py PARENT_PID`, reading JSON orders from its stdin, one per line:

  {"arm": SECONDS, "line": TEXT, "record": PATH or null, "data": {...}}   start the clock
  {"disarm": true}                                                         stop it

When an armed clock runs out it prints TEXT to stderr, writes `data` as JSON to PATH and kills the
parent with SIGKILL (the launcher then ends the job). It exits when its stdin closes (the parent
is gone). Standard library only, so it starts in milliseconds and needs nothing of the parent's.
"""

import json
import os
import select
import signal
import sys
import time


def expire(parent: int, order: dict) -> None:
    os.write(2, (order["line"] + "\n").encode())
    if order.get("record"):
        tmp = f"{order['record']}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(order["data"], f)
            os.replace(tmp, order["record"])
        except OSError:
            pass
    os.kill(parent, signal.SIGKILL)


def main(parent: int) -> None:
    armed, until, pending = None, None, b""
    while True:
        timeout = None if until is None else max(0.0, until - time.monotonic())
        ready, _, _ = select.select([0], [], [], timeout)
        if not ready:
            expire(parent, armed)
            return
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            order = json.loads(line)
            armed, until = (order, time.monotonic() + order["arm"]) if "arm" in order else (None, None)


if __name__ == "__main__":
    main(int(sys.argv[1]))
