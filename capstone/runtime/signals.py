"""Signals that ask a run to stop: the handlers set the stop flag (capstone.runtime.stop), which the
training loop agrees on across ranks and turns into a checkpoint and a clean exit (summary status
"preempted", exit status 0 on every rank).

- SIGUSR1: Slurm's warning before a time limit (--signal=B:USR1@60), or `kill -USR1 <mpirun pid>`
  (mpirun forwards it to every rank). The clean stop for any step length: no deadline follows.
- SIGTERM, SIGINT: scancel, a Ctrl-C under srun (srun passes it to every task), a kill of a rank.
  A second SIGINT aborts without saving.
- Ctrl-C or `kill -INT|-TERM <mpirun pid>` under Open MPI's mpirun: mpirun forwards neither. It
  runs its kill sequence on the ranks: SIGCONT at once, SIGTERM `odls_base_sigkill_timeout`
  seconds later, SIGKILL as long again; and it exits 1 whatever the ranks did. The SIGCONT is the
  ranks' first notice, so under mpirun (OMPI_MCA_orte_hnp_uri set) a SIGCONT is a stop request
  too, unless it ends a stop: Ctrl-Z reaches the ranks as SIGSTOP (mpirun turns SIGTSTP into it)
  and fg as SIGCONT, and a heartbeat thread tells that resume (the process stood still for over a
  second) from the kill sequence (a Ctrl-Z shorter than a second looks like Ctrl-C: the run stops
  cleanly). scripts/env.sh sets that timeout
  to 3 s, which gives a run about 6 s from the Ctrl-C to finish its step and save.
The loop reads the flag in each step's gradient reduction: a request is honoured at the end of the
step in progress, or of the next one if it came after that reduction. Bound: two steps plus one
save. For a slower run raise OMPI_MCA_odls_base_sigkill_timeout, or stop it with SIGUSR1.
"""

import atexit
import os
import signal
import threading
import time

from capstone.runtime import stop

_GAP = 1.0                      # seconds without a heartbeat: the process was stopped (SIGSTOP)
_beat = [time.monotonic(), -_GAP]   # the heartbeat thread's last tick, and when it last saw a gap
_REASONS = {signal.SIGUSR1: "SIGUSR1", signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT",
            signal.SIGCONT: "mpirun's ending of the job (Ctrl-C, a kill, or a failed rank)"}


def install() -> None:
    """Install the handlers; call first thing, so an early signal is not fatal either. Once: a second
    call leaves them as they are."""
    if signal.getsignal(signal.SIGUSR1) is _request:
        return
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, _request)
    atexit.register(_ended)
    if os.environ.get("OMPI_MCA_orte_hnp_uri"):   # launched by Open MPI's mpirun (not srun)
        _beat[0] = time.monotonic()
        threading.Thread(target=_heartbeat, name="stop-heartbeat", daemon=True).start()
        signal.signal(signal.SIGCONT, _request)


def _ended() -> None:
    """At exit (an exit code every rank agrees on: a failure of one rank aborts the job instead),
    ignore SIGTERM and SIGUSR1: Python puts the default action back on its handled signals while it
    finalizes, and both would kill a rank that has finished. SIGTERM: when the first rank exits
    non-zero, srun --kill-on-bad-exit and mpirun send it to the others, which would end "Terminated"
    and the job with 143, not the 2 of a refused start or the 1 of a failed run. SIGUSR1: Slurm's
    time-limit warning landing as a run completes (a requeued job's too) would end the job with 138,
    failed. SIG_IGN survives that reset; SIGKILL still ends them."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _heartbeat() -> None:
    while True:
        now = time.monotonic()
        if now - _beat[0] > _GAP:
            _beat[1] = now
        _beat[0] = now
        time.sleep(0.1)


def _just_resumed() -> bool:
    """Whether the process has just been continued after a stop (either the heartbeat has not
    ticked since, or it has and saw the gap)."""
    now = time.monotonic()
    return now - _beat[0] > _GAP or now - _beat[1] < _GAP


def _rank() -> int:
    ranks = (os.environ.get(name, "") for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"))
    return next((int(rank) for rank in ranks if rank.isdigit()), 0)


def _request(signum, frame) -> None:
    if stop.requested() and signum == signal.SIGINT:
        raise KeyboardInterrupt("second SIGINT: aborting without a checkpoint")
    if stop.requested() or signum == signal.SIGCONT and _just_resumed():   # already asked; fg after Ctrl-Z: carry on
        return
    stop.request(_REASONS.get(signum, f"signal {signum}"))
    if _rank() == 0:  # os.write: safe inside a handler, unlike print
        os.write(2, f"capstone: {stop.reason()}: saving a checkpoint at the end of this step, then stopping "
                    f"(a second SIGINT aborts without saving)\n".encode())
