"""Fault injection for tests, driven by the environment: CAPSTONE_FAULT=<point>:<rank>[:<step>].

Save points (SIGKILL, like a node dying mid-checkpoint): before_data, after_data, before_rename,
before_pointer, at the save of step <step> (any save if no step is given). Step point:
raise_in_step (an ordinary exception on one rank at step <step>, default 1, to prove that one
rank's error aborts the job instead of hanging the others). flip_param_bit: one bit of one rank's parameters flipped after the update of step <step>.
stall:<rank>:<step>[:<where>]: that rank sleeps STALL_S, silent, like a hung or unreachable node,
at the start of step <step> (default 1), or at save point <where> of the save of step <step>;
the others must end the job at --collective-timeout (capstone.deadline).
write_error: an OSError on one rank
while it writes its shard of the save of step <step> (like a full disk on one node).
With no CAPSTONE_FAULT nothing happens. CAPSTONE_FAULT_RESTART=N limits the fault to the launch
of a Slurm job whose SLURM_RESTART_COUNT is N (0: before any requeue), so a requeued job runs clean. `Injections` are the training-side faults that the
command line asks for (--inject-lr-spike, --inject-nan), to exercise the divergence guard.
"""

from __future__ import annotations

import os
import signal
import sys
import time

KILL_POINTS = ("before_data", "after_data", "before_rename", "before_pointer")
POINTS = KILL_POINTS + ("raise_in_step", "write_error", "flip_param_bit", "stall")
STALL_S = 60.0


class Injections:
    """--inject-lr-spike STEP:MULT and --inject-nan STEP[:COUNT], asked step by step."""

    def __init__(self, lr_spike: tuple[int, float] | None = None, nan: tuple[int, int] | None = None):
        self.lr_spike, self.nan = lr_spike, nan

    def lr_mult(self, step: int) -> float:
        return self.lr_spike[1] if self.lr_spike is not None and self.lr_spike[0] == step else 1.0

    def poison(self, step: int, rank: int, grads) -> None:
        """Make rank 0's gradient NaN on the steps --inject-nan names."""
        if self.nan is not None and self.nan[0] <= step < self.nan[0] + self.nan[1] and rank == 0:
            grads[0] = float("nan")


def flip_param_bit(rank: int, step: int, params) -> None:
    """flip_param_bit:<rank>:<step>: flip the lowest bit of params[0] on that rank after that step's update
    (a replica that silently differs, for invariant (b))."""
    spec = _spec()
    if spec is not None and spec[0] == "flip_param_bit" and spec[1] == rank and spec[2] in (None, step):
        params.view("u4")[0] ^= 1


class InjectedFault(RuntimeError):
    """Raised on purpose by CAPSTONE_FAULT=raise_in_step:<rank>."""


def _spec():
    spec = os.environ.get("CAPSTONE_FAULT", "")
    only = os.environ.get("CAPSTONE_FAULT_RESTART")   # a Slurm job's launch: the fault fires in that one only
    if not spec or only is not None and only != os.environ.get("SLURM_RESTART_COUNT", "0"):
        return None
    point, _, rest = spec.partition(":")
    rank, _, step = rest.partition(":")
    step, _, where = step.partition(":")
    if point not in POINTS or where and (point != "stall" or where not in KILL_POINTS):
        raise ValueError(f"CAPSTONE_FAULT={spec!r}: the point must be one of {', '.join(POINTS)} "
                         f"(stall:<rank>:<step>:<where> takes one of {', '.join(KILL_POINTS)})")
    return point, int(rank or 0), int(step) if step else None, where or "stall"


def point(name: str, rank: int, step: int | None = None) -> None:
    """Act if CAPSTONE_FAULT names this point and rank (and step, for raise_in_step)."""
    spec = _spec()
    if spec is not None and spec[0] == "stall" and spec[3] == name and spec[1] == rank and step == (spec[2] or 1):
        print(f"[rank {rank}] CAPSTONE_FAULT: stalling this rank for {STALL_S:.0f} s at step {step} ({name})",
              file=sys.stderr, flush=True)
        time.sleep(STALL_S)
        return
    if spec is None or spec[0] != name or spec[1] != rank or name == "stall":
        return
    if spec[2] is not None and spec[2] != step or name == "raise_in_step" and step != (spec[2] or 1):
        return
    if name == "raise_in_step":
        raise InjectedFault(f"injected failure on rank {rank} at step {step} (CAPSTONE_FAULT)")
    if name == "write_error":
        raise OSError(28, "No space left on device (injected by CAPSTONE_FAULT)")
    print(f"[rank {rank}] CAPSTONE_FAULT: killing this rank at '{name}'", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
