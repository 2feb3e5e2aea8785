"""Fault injection for tests: `Faults` implements the run's hooks (capstone.step.hooks).

From the environment, CAPSTONE_FAULT=<action>:<rank>[:<step>[:<point>]] acts on one rank:

  before_data, after_data, before_rename, between_renames, before_pointer
                  SIGKILL (a node dying) at that point of the save of step <step> (any save if none)
  write_error     an OSError while that rank writes its shard of the save of step <step>
  raise_in_step   an ordinary exception at the start of step <step> (default 1)
  flip_param_bit  one bit of the rank's parameters flipped after the update of step <step>
  stall           sleep STALL_S seconds, silent (a hung node), at hook point <point> of step <step>
  stop            SIGSTOP itself (a real stopped process) at hook point <point> of step <step>
  usr1            SIGUSR1 to itself (a real stop request) at the start of step <step>

A hook point is "step" (the default), a collective's kind ("reduce_scatter", "allreduce_stats",
"tp_allreduce", "alltoall", "allreduce_eval", "allgather", ...) or a checkpoint point
("save.before_data", ...); step 0 is start-up. CAPSTONE_FAULT_PIDS=DIR makes every rank write its
pid to DIR/<rank> first, so a test can kill a stopped rank. CAPSTONE_FAULT_RESTART=N limits the
fault to the launch of a Slurm job whose SLURM_RESTART_COUNT is N. The flags --inject-lr-spike
STEP:MULT, --inject-nan STEP[:COUNT] and --sleep-per-step exercise the divergence guard and stops;
--inject-grad-sign and --inject-no-update STEP[:COUNT] (a gradient of the wrong sign; none reaching
the optimizer) exercise invariant (a).
"""

import os
import signal
import sys
import time

import numpy as np

from capstone.step.hooks import Hooks

SAVE_POINTS = ("before_data", "after_data", "before_rename", "between_renames", "before_pointer")
ACTIONS = SAVE_POINTS + ("raise_in_step", "write_error", "flip_param_bit", "stall", "stop", "usr1")
STALL_S = 60.0
POINT_OF = {**{a: f"save.{a}" for a in SAVE_POINTS}, "between_renames": "publish.between_renames",
            "write_error": "save.write", "raise_in_step": "step", "usr1": "step"}


class InjectedFault(RuntimeError):
    """Raised on purpose by CAPSTONE_FAULT=raise_in_step:<rank>."""


def parse(spec: str) -> tuple[str, int, int | None, str]:
    """(action, rank, step or None, hook point) of a CAPSTONE_FAULT value."""
    action, rank, step, point = (spec.split(":", 3) + [""] * 3)[:4]
    if action not in ACTIONS or point and action not in ("stall", "stop"):
        raise ValueError(f"CAPSTONE_FAULT={spec!r}: the action must be one of {', '.join(ACTIONS)}; only stall "
                         f"and stop take a hook point (<action>:<rank>:<step>:<point>)")
    step = int(step) if step else (1 if action == "raise_in_step" else None)
    return action, int(rank or 0), step, POINT_OF.get(point, point) or POINT_OF.get(action, "step")


class Faults(Hooks):
    """The hooks of a test run: CAPSTONE_FAULT on this rank, and the --inject-* flags."""

    def __init__(self, rank: int, lr_spike=None, nan=None, sleep_per_step: float = 0.0, grad_sign=None, no_update=None):
        self.rank, self.lr_spike, self.nan, self.sleep = rank, lr_spike, nan, sleep_per_step
        self.grad_sign, self.no_update = grad_sign, no_update
        spec = os.environ.get("CAPSTONE_FAULT", "")
        only = os.environ.get("CAPSTONE_FAULT_RESTART")   # a Slurm job's launch: the fault fires in that one only
        self.fault = parse(spec) if spec and only in (None, os.environ.get("SLURM_RESTART_COUNT", "0")) else None
        if os.environ.get("CAPSTONE_FAULT_PIDS"):
            with open(os.path.join(os.environ["CAPSTONE_FAULT_PIDS"], str(rank)), "w") as f:
                f.write(f"{os.getpid()}\n")

    def _mine(self, point: str, step: int | None) -> str | None:
        """The action if the fault names this rank, point and step."""
        action, rank, at_step, at_point = self.fault or (None,) * 4
        return action if (rank, at_point) == (self.rank, point) and at_step in (None, step or 0) else None

    def at(self, point: str, step: int | None = None) -> None:
        super().at(point, step)
        step = self.step if step is None else step   # a save's step: its own thread's
        action, where = self._mine(point, step), f"{point} of step {step or 0}"
        if action == "raise_in_step":
            raise InjectedFault(f"injected failure on rank {self.rank} at step {self.step} (CAPSTONE_FAULT)")
        if action == "write_error":
            raise OSError(28, "No space left on device (injected by CAPSTONE_FAULT)")
        if action == "usr1":
            os.kill(os.getpid(), signal.SIGUSR1)
        elif action == "stall":
            say(self.rank, f"stalling this rank for {STALL_S:.0f} s at {where}")
            time.sleep(STALL_S)
        elif action in SAVE_POINTS + ("stop",):
            say(self.rank, f"{'stopping' if action == 'stop' else 'killing'} this rank at {where}")
            os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)

    def gradients(self, step: int, micro: int, grads) -> None:
        """--inject-nan: rank 0's gradient NaN on the steps it names (after the first micro-batch)."""
        if grads is not None and self.rank == 0 and micro == 0 and self.nan and 0 <= step - self.nan[0] < self.nan[1]:
            grads[0] = float("nan")

    def reduced(self, step: int, grad_shard) -> None:
        """--inject-grad-sign STEP[:COUNT]: every rank's shard of the summed gradient negated, as a sign
        error in the backward pass would; --inject-no-update: zeroed, as if the gradient never reached
        the optimizer (Adam's update is then 0). From STEP on, COUNT steps (0: to the end); the logged
        gradient norm is the true one."""
        if _in(step, self.grad_sign):
            np.negative(grad_shard, out=grad_shard)
        if _in(step, self.no_update):
            grad_shard.fill(0.0)

    def learning_rate(self, step: int, lr: float) -> float:
        return lr * self.lr_spike[1] if self.lr_spike is not None and self.lr_spike[0] == step else lr

    def parameters(self, step: int, params) -> None:
        """flip_param_bit: flip the lowest bit of params[0] on that rank after that step's update
        (a replica that silently differs, for invariant (b))."""
        if self._mine("step", step) == "flip_param_bit":
            params.view("u4")[0] ^= 1

    def step_done(self, step: int) -> None:
        if self.sleep:
            time.sleep(self.sleep)


def _in(step: int, span: tuple[int, int] | None) -> bool:
    """Whether `step` is in (FROM, COUNT): FROM <= step < FROM + COUNT (COUNT 0: no end)."""
    return span is not None and step >= span[0] and (not span[1] or step < span[0] + span[1])


def say(rank: int, text: str) -> None:
    print(f"[rank {rank}] CAPSTONE_FAULT: {text}", file=sys.stderr, flush=True)
