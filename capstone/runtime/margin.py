"""Does a stop fit Open MPI's kill sequence? Said at start, from the checkpoint's size and the disk's
measured speed, and once more after the first steps, from their measured time.

Under Open MPI's mpirun a Ctrl-C or `kill <mpirun pid>` is followed by SIGKILL 2 x
odls_base_sigkill_timeout seconds later (OMPI_MCA_odls_base_sigkill_timeout, 1 s by default). A
signal's stop takes at most the rest of the step in progress, then a save and the run's end (the
check of invariant (d) reloads that save). Before the first step, rank 0 times writing, syncing and
reading back with its sha256 a probe file in OUT/checkpoints (up to PROBE_BYTES of the checkpoint's
size, removed at once; a killed one is removed by the next start) and scales it to the checkpoint's
size, which the plan fixes: the save's time. If that alone exceeds three quarters of the kill
sequence, rank 0 says so at once, with what to do. Otherwise, after step MEASURE of the launch, the
longest step since the first (its warm-up left out) plus that save must fit, or rank 0 says so then.
The verdict is a "stop_margin" event of metrics.jsonl, written once; a run that fits prints nothing.
Not under mpirun (srun, one process), or under scripts/launch: nothing measured (no kill sequence
follows). No checkpoint is written for the measurement: the run's saves are the Checkpointer's.
"""

import contextlib
import hashlib
import os
import time

from capstone.checkpoint import files
from capstone.step.state import ROWS

MEASURE = 4              # the step of a launch after which its step time is known
SPARE = 0.75             # a stop must fit in this share of the kill sequence
PROBE_BYTES = 32 << 20   # the most the disk's probe writes
MIB = 1 << 20


def kill_sequence() -> tuple[float, str] | None:
    """(seconds from Open MPI's first signal to its SIGKILL, the timeout as set), None if not under mpirun."""
    if not os.environ.get("OMPI_MCA_orte_hnp_uri") or os.environ.get("CAPSTONE_PLAIN_MPIRUN"):
        return None   # not Open MPI's mpirun, or under scripts/launch, which turns a Ctrl-C into SIGUSR1
    raw = os.environ.get("OMPI_MCA_odls_base_sigkill_timeout", "1")
    with contextlib.suppress(ValueError):
        return 2 * max(float(raw), 0.0), raw
    return 2.0, raw


class StopMargin:
    """One launch's verdict: made before its first step (collective), told of each step's end."""

    def __init__(self, run, start_step: int):
        world = run.grid.world
        self.run, self.start_step, self.ends = run, start_step, [time.perf_counter()]
        self.seq = world.bcast_json(kill_sequence())   # rank 0's: a remote node's ranks lack mpirun's environment
        self.nbytes = files.estimated_size(run.ckpt.layout.padded * len(ROWS) * 4, world.size)
        measured = save_seconds(run.ckpt.directory, self.nbytes) if self.seq and world.rank == 0 else None
        self.save_s = world.bcast_json(measured)
        self.decided = self.save_s is None   # not under mpirun, or the probe could not be written
        if not self.decided and self.save_s > SPARE * self.seq[0]:
            self._verdict(0.0, start=True)

    def step_done(self, step: int, stopping: bool) -> None:
        """At the end of every step: at step start + MEASURE (unless the run ends there), the verdict."""
        if self.decided:
            return
        self.ends.append(time.perf_counter())
        if step == self.start_step + MEASURE and not stopping and step < self.run.tcfg.steps:
            self._verdict(max(b - a for a, b in zip(self.ends[1:], self.ends[2:])), start=False)

    def _verdict(self, period: float, start: bool) -> None:
        self.decided = True
        need = period + self.save_s
        fits = need <= SPARE * self.seq[0]
        if self.run.grid.world.rank != 0:
            return
        self.run.metrics.write({"event": "stop_margin", "step_s": None if start else period, "save_s": self.save_s,
                                "checkpoint_bytes": self.nbytes, "kill_sequence_s": self.seq[0], "fits": fits,
                                "at_step": self.start_step if start else self.start_step + MEASURE})
        if not fits:
            print(warning(need, period, self.save_s, self.nbytes, self.seq, None if start else self.start_step),
                  flush=True)


def warning(need: float, period: float, save: float, nbytes: int, seq: tuple[float, str], start_step) -> str:
    took = (f"a save of the {nbytes / MIB:.0f} MiB checkpoint with its check takes about {save:.2f} s at this "
            f"disk's measured speed, before any step's time" if start_step is None else
            f"a step of {period:.2f} s (the longest of steps {start_step + 2}-{start_step + MEASURE}) and a save with "
            f"its check of about {save:.2f} s (the {nbytes / MIB:.0f} MiB checkpoint at this disk's measured speed)")
    return (f"warning: a Ctrl-C may not save this run. Under mpirun a Ctrl-C or `kill <mpirun pid>` is followed by "
            f"SIGKILL {seq[0]:g} s later (2 x OMPI_MCA_odls_base_sigkill_timeout, {seq[1]}), and a stop here takes up "
            f"to {need:.2f} s: {took}. Stop it with `kill -USR1 <mpirun pid>` (no deadline), run it under "
            f"scripts/launch (a Ctrl-C becomes SIGUSR1), or export OMPI_MCA_odls_base_sigkill_timeout="
            f"{max(3, int(need / SPARE) + 1)} before mpirun.")


def save_seconds(directory: str, nbytes: int) -> float | None:
    """Seconds to write, sync and read back with its sha256 `nbytes` in `directory`: a probe file of at
    most PROBE_BYTES, timed and scaled; None if it cannot be written (the run's own save will say why)."""
    size = max(1, min(nbytes, PROBE_BYTES))
    path, block = os.path.join(directory, files.PROBE), bytes(range(256)) * 4096   # 1 MiB
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for start in range(0, size, len(block)):
                f.write(block[:size - start])
            f.flush()
            os.fsync(f.fileno())
        with open(path, "rb") as f:
            hashlib.file_digest(f, "sha256")
        return (time.perf_counter() - t0) * nbytes / size
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
