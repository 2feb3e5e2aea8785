"""Does a stop fit Open MPI's kill sequence? Measured by the run itself, once, near its start.

Under Open MPI's mpirun a Ctrl-C or `kill <mpirun pid>` is followed by SIGKILL 2 x
odls_base_sigkill_timeout seconds later (OMPI_MCA_odls_base_sigkill_timeout, 1 s by default). A
signal's stop takes at most the rest of the step in progress, then a save and the run's end (the
check of invariant (d) reloads that save). After step MEASURE of a launch, the run has timed its
steps (the first, with its warm-up, left out) and now times one save and reload of its state into
OUT/checkpoints/.stop-probe (removed at once; a killed one is removed by the next start). If a step
plus that exceeds three quarters of the kill sequence, rank 0 says so once, with what to do;
a run that fits says nothing. Both go to metrics.jsonl as a "stop_margin" event. Not under
mpirun (srun, one process), or under scripts/launch: nothing measured (no kill sequence follows).
"""

from __future__ import annotations

import os
import shutil
import time

from capstone import checkpoint
from capstone.checkpoint import files
from capstone.hooks import NONE

MEASURE = 4        # the step of a launch after which the stop's time is measured
SPARE = 0.75       # a stop must fit in this share of the kill sequence
_ends: list[float] = []   # this launch's step ends (time.perf_counter), up to the measurement


def kill_sequence() -> tuple[float, str] | None:
    """(seconds from Open MPI's first signal to its SIGKILL, the timeout as set), None if not under mpirun."""
    if not os.environ.get("OMPI_MCA_orte_hnp_uri") or os.environ.get("CAPSTONE_PLAIN_MPIRUN"):
        return None   # not Open MPI's mpirun, or under scripts/launch, which turns a Ctrl-C into SIGUSR1
    raw = os.environ.get("OMPI_MCA_odls_base_sigkill_timeout", "1")
    try:
        return 2 * max(float(raw), 0.0), raw
    except ValueError:
        return 2.0, raw


def check(run, step: int, start_step: int, stopping: bool) -> None:
    """Collective: call on all ranks at the end of every step. At step start_step + MEASURE (unless
    the run ends there), the measurement; the warning on rank 0 if the stop does not fit."""
    if step <= start_step + MEASURE:
        _ends.append(time.perf_counter())
    if step != start_step + MEASURE or stopping or step >= run.tcfg.steps:
        return
    seq = run.grid.world.bcast_json(kill_sequence())   # rank 0's: a remote node's ranks lack mpirun's environment
    if seq is None:
        return
    period = max(b - a for a, b in zip(_ends, _ends[1:]))
    save = probe(run)
    if save is None or run.grid.world.rank != 0:
        return
    need, fits = period + save, period + save <= SPARE * seq[0]
    run.metrics.write({"event": "stop_margin", "step_s": period, "save_s": save, "kill_sequence_s": seq[0],
                       "fits": fits})
    if not fits:
        print(warning(need, period, save, seq, start_step), flush=True)


def warning(need: float, period: float, save: float, seq: tuple[float, str], start_step: int) -> str:
    return (f"warning: a Ctrl-C may not save this run. Under mpirun a Ctrl-C or `kill <mpirun pid>` is followed by "
            f"SIGKILL {seq[0]:g} s later (2 x OMPI_MCA_odls_base_sigkill_timeout, {seq[1]}), and a stop here takes up "
            f"to {need:.2f} s: a step of {period:.2f} s (the longest of steps {start_step + 2}-{start_step + MEASURE}) "
            f"and a save with its check of {save:.2f} s. Stop it with `kill -USR1 <mpirun pid>` (no deadline), run it "
            f"under scripts/launch (a Ctrl-C becomes SIGUSR1), or export OMPI_MCA_odls_base_sigkill_timeout="
            f"{max(3, int(need / SPARE) + 1)} before mpirun.")


def probe(run) -> float | None:
    """Collective: seconds (rank 0's clock) to save the run's state as a checkpoint and reload it,
    in OUT/checkpoints/.stop-probe, removed after; None if it could not be saved (e.g. no space)."""
    world = run.grid.world
    directory = os.path.join(run.ckpt.directory, files.PROBE)
    run.ckpt.drain()                          # one parallel-HDF5 file at a time (capstone.checkpoint.background)
    hooks, world.hooks = world.hooks, NONE    # a test's faults are for the run's own saves
    t0 = time.perf_counter()
    try:
        stored = run.ckpt.view.to_stored(run.opt.state)
        man = checkpoint.save(world, directory, run.state.step, stored, run.ckpt.layout, run.ckpt.extra(run.state))
        checkpoint.load(world, man["path"], run.ckpt.layout, run.ckpt.identity.must_match())
        return time.perf_counter() - t0
    except checkpoint.CheckpointError:
        return None
    finally:
        world.hooks = hooks
        world.Barrier("barrier after the stop-time measurement")
        if world.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
