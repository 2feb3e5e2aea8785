"""Stop requests: SIGTERM and SIGUSR1 (Slurm's warning before a time limit or preemption) set a
flag that the training loop agrees on across ranks at the next step and turns into a checkpoint
and a clean exit."""

from __future__ import annotations

import signal

_requested = [False]


def install() -> None:
    """Install the handlers; call first thing, so an early signal is not fatal either."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _request)


def _request(signum, frame) -> None:
    _requested[0] = True


def requested() -> bool:
    return _requested[0]
