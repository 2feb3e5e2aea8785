"""Every serial tool's `__main__`: `sys.exit(run_tool(main))`, quiet when its stdout's reader leaves early.

`python -m capstone.export RUN --out M | head -0`: Python ignores SIGPIPE, so a write to the closed pipe
raises BrokenPipeError, which used to end the tool in a traceback and exit 1 although its work (the
export written, the dataset prepared) was done. The tools print after their work, so here the
remaining output is dropped (stdout goes to /dev/null, as Python's docs on SIGPIPE advise, so the
interpreter's own flush at exit is quiet too) and the tool exits 141 = 128 + SIGPIPE, what a shell
reports for `yes | head -1` or `cat FILE | head -1`: a script with `set -o pipefail` tells it apart from
1, which in this project means the run failed. The tools do not restore SIGPIPE's default action,
which Python's docs advise against (it would kill the process mid-write, with no cleanup).
"""

import os
import signal
import sys
from typing import Callable

READER_LEFT = 128 + signal.SIGPIPE       # 141


def fail(message, code: int = 2) -> int:
    """`message` on stderr as the tool's error ("error: ..."); returns the exit code `code`."""
    print(f"error: {message}", file=sys.stderr)
    return code


def run_tool(main: Callable[[], int | None]) -> int | None:
    """`main()`'s exit code, or READER_LEFT, quietly, when stdout's reader has gone."""
    try:
        code = main()
        sys.stdout.flush()                   # the buffered last lines fail here, not in the exit's flush
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_LEFT
