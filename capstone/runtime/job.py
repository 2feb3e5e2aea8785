"""The job around a training step, what the batch scripts and scripts/launch run: the rules of a job
in tested Python, where the shell keeps `srun`, `mpirun` and `scontrol`.

    python -m capstone.runtime.job RUN_DIR COMMAND...   run the step COMMAND, watch it, end the job
    python -m capstone.runtime.job make-run-dir DIR     a batch job's run directory, made or refused

`run` refuses mistyped switches and a second --out before the step starts (exit 2), starts the step
(under scripts/launch in a session of its own, out of the terminal's Ctrl-C, which it turns into
SIGUSR1: Open MPI's mpirun forwards that with no kill sequence), forwards a stop request (SIGUSR1:
Slurm's time-limit warning, a preemption, `scancel --signal=USR1 --batch`) once the step is
CAPSTONE_SIGNAL_SETTLE ms old (mpirun drops one in its first moments), ends a step that lingers
CAPSTONE_ABORT_GRACE seconds after a rank's collective timed out (its record, RUN_DIR/
collective-timeout.json), and when the step has ended reads how (summary.json), requeues a job
that checkpointed (`scontrol requeue`, up to CAPSTONE_MAX_REQUEUES restarts; CAPSTONE_REQUEUE=0:
never) or says how to resume, and writes the ending's record when the ranks could not
(capstone.runtime.ending). It exits with the step's status. docs/cluster.md and docs/multinode.md
say how to use it.
"""

import signal
import sys

import os

if __name__ == "__main__":   # before anything else: Slurm's warning (or a Ctrl-C) may come as the job starts
    _early: list = []
    for _sig in (signal.SIGUSR1, signal.SIGINT) if os.environ.get("CAPSTONE_PLAIN_MPIRUN") else (signal.SIGUSR1,):
        signal.signal(_sig, lambda sig, _: _early.append(sig))   # a Ctrl-C also when started with it ignored

import contextlib
import subprocess
import time
from dataclasses import dataclass

from capstone.runtime import ending, relaunch

SWITCHES = {"CAPSTONE_REQUEUE": ("^[01]$", "1 (requeue after a preemption checkpoint, the default) or 0 (just exit)"),
            "CAPSTONE_MAX_REQUEUES": ("^[0-9]+$", "a whole number (of requeues)"),
            "CAPSTONE_MAX_RELAUNCHES": ("^[0-9]+$", "a whole number (of relaunches after a lost rank or host)"),
            "CAPSTONE_ABORT_GRACE": ("^[0-9]+$", "a whole number (of seconds)")}


def log(text: str) -> None:
    print(f"[capstone.sbatch {time.strftime('%H:%M:%S')}] {text}", flush=True)


class JobError(Exception):
    """A job that must not start (exit 2), with what to do."""


@dataclass(frozen=True)
class Switches:
    """The job's environment switches, checked."""

    requeue: bool = True
    max_requeues: int = 20
    grace: float = 3.0
    settle_ms: int = 3000
    plain: bool = False      # scripts/launch: plain mpirun, no Slurm (a Ctrl-C becomes SIGUSR1)
    relaunches: int = 3      # after a lost rank or host (capstone.runtime.relaunch; in a batch job 0 by default)

    @classmethod
    def read(cls, env) -> "Switches":
        import re
        for name, (pattern, what) in SWITCHES.items():
            if (value := env.get(name, "")) and not re.match(pattern, value):
                raise JobError(f"{name}='{value}': it must be {what}: unset it for the default or set it so, "
                               f"and submit again")
        settle = env.get("CAPSTONE_SIGNAL_SETTLE", "3000")
        if not settle.isdigit():
            log(f"warning: CAPSTONE_SIGNAL_SETTLE='{settle}' is not a number of milliseconds; using 3000")
            settle = "3000"
        return cls(env.get("CAPSTONE_REQUEUE", "1") != "0", int(env.get("CAPSTONE_MAX_REQUEUES") or 20),
                   float(env.get("CAPSTONE_ABORT_GRACE") or 3), int(settle), bool(env.get("CAPSTONE_PLAIN_MPIRUN")),
                   int(env.get("CAPSTONE_MAX_RELAUNCHES") or (0 if env.get("SLURM_JOB_ID") else 3)))


def refuse_another_out(run_dir: str, command: list[str]) -> None:
    """JobError unless the step's --out is the run directory this job watches (its summary.json and
    collective-timeout.json): a second --out trained elsewhere and a preemption then found nothing here."""
    out, train = None, "capstone.train" in command
    for i, arg in enumerate(command):
        if arg == "--out" and i + 1 < len(command):
            out = command[i + 1]
        elif arg.startswith("--out="):
            out = arg[len("--out="):]
    if train and out is None:
        raise JobError(f"no --out in the command: capstone.train would write to runs/run-<time>, not to the run "
                       f"directory {run_dir} that this script watches: add --out {run_dir}")
    if out is not None and os.path.realpath(out) != os.path.realpath(run_dir):
        raise JobError(f"the job's --out {out} is not the run directory {run_dir} that this script watches: give "
                       f"the run directory once, as CAPSTONE_RUN_DIR=DIR before sbatch (the batch scripts pass "
                       f"--out themselves), or as scripts/launch DIR ... --out DIR")


def make_run_dir(path: str, env) -> None:
    """A batch job's run directory: refused when it is the default one of a job's first start and already
    holds a run (an earlier job with the same id wrote it), made otherwise (JobError if it cannot be)."""
    first = not env.get("CAPSTONE_RUN_DIR") and env.get("SLURM_RESTART_COUNT", "0") == "0"
    if first and os.path.isdir(path) and os.listdir(path):
        job = env.get("SLURM_JOB_ID", "?")
        raise JobError(f"{path} already holds a run, but this is the first start of job {job}: an earlier job with "
                       f"the same id wrote it (another cluster, or job ids started again). Move it away and submit "
                       f"again, or continue that run on purpose with CAPSTONE_RUN_DIR={path} sbatch ...")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:   # a file there, no permission, a missing mount
        raise JobError(f"cannot create the run directory {path} ({exc.strerror}): set CAPSTONE_RUN_DIR to a "
                       f"directory this job can write, on a filesystem every node sees, and submit again") from None


class Step:
    """The running step, and the stop requests and Ctrl-Cs it has been sent."""

    def __init__(self, command: list[str], switches: Switches):
        self.switches, self.pending, self.signalled, self.interrupts = switches, False, False, 0
        self.started, self.launched = time.time(), time.monotonic()
        self.proc = subprocess.Popen(command, start_new_session=switches.plain)

    def stop_requested(self, quiet: bool = False) -> None:
        self.signalled = self.pending = True
        if not quiet:
            log("SIGUSR1 (time limit near or preemption): asking the job step to checkpoint and stop")
        self.forward()

    def interrupted(self) -> None:   # scripts/launch: a Ctrl-C reaches only this process (the step has its own session)
        self.interrupts += 1
        if self.interrupts == 1:
            log("Ctrl-C: asking the job to checkpoint and stop (SIGUSR1 to mpirun, no deadline); a second Ctrl-C "
                "ends it without saving")
            self.stop_requested(quiet=True)
        else:
            log("second Ctrl-C: ending the job without saving (SIGINT to mpirun)")
            self.pending = False
            self._send(signal.SIGINT)

    def forward(self) -> None:
        """The pending stop request to the step, once it is old enough to act on it."""
        if self.pending and (time.monotonic() - self.launched) * 1000 >= self.switches.settle_ms:
            self.pending = False
            self._send(signal.SIGUSR1)

    def _send(self, sig) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def end_lingering(self, record: str) -> None:
        """A rank's collective timed out: end the step if it outlives the record by the grace period
        (mpirun waits for a lost node's daemon, srun for its slurmstepd)."""
        age = time.time() - os.stat(record).st_mtime
        if age < self.switches.grace:
            return
        log(f"a rank's collective timed out {int(age)} s ago and the job step is still running (waiting for an "
            f"unreachable node): ending it. {_read(record)}")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self._send(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2)
                return

    def wait(self, run_dir: str) -> int:
        """The step's exit status (128 + N for a signal, as a shell says it), forwarding and watching meanwhile."""
        while self.proc.poll() is None:
            time.sleep(0.1)
            self.forward()
            if record := timeout_record(run_dir, self.started):
                self.end_lingering(record)
        rc = self.proc.returncode
        return 128 - rc if rc < 0 else rc


def timeout_record(run_dir: str, since: float) -> str | None:
    """RUN_DIR/collective-timeout.json if a rank wrote it during this step."""
    record = os.path.join(run_dir, "collective-timeout.json")
    with contextlib.suppress(OSError):
        return record if os.stat(record).st_mtime >= int(since) else None
    return None


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().strip()
    return ""


def requeue(reason: str, switches: Switches, env) -> bool:
    """`scontrol requeue` of this job, if the switches allow another restart; True if Slurm took it."""
    job, restarts = env.get("SLURM_JOB_ID"), int(env.get("SLURM_RESTART_COUNT") or 0)
    if not job or not switches.requeue:
        return False
    if restarts >= switches.max_requeues:
        log(f"not requeueing: job {job} has been requeued {restarts} times, CAPSTONE_MAX_REQUEUES="
            f"{switches.max_requeues}")
        return False
    log(reason.format(job=job, restart=restarts + 1))
    if subprocess.run(["scontrol", "requeue", job]).returncode == 0:
        return True
    log("scontrol requeue failed")
    return False


def resume(run_dir: str, said: str, switches: Switches, env, advice: str = "") -> bool:
    """Requeue the job to resume from the last checkpoint (True if Slurm took it), else say how to resume;
    `said` starts both lines, `advice` ends the requeue's."""
    latest = os.path.join(run_dir, "checkpoints", "latest")
    if requeue(said + "requeueing job {job} (restart {restart}) to resume from " + latest + advice, switches, env):
        return True
    hint = (f"CAPSTONE_RUN_DIR={run_dir} sbatch <this script> [same flags]" if env.get("SLURM_JOB_ID")
            or not switches.plain else f"rerun the same mpirun command with --resume auto (run directory {run_dir})")
    log(f"{said}to resume: {hint}")
    return False


def after_timeout(run_dir: str, record: str, switches: Switches, env) -> None:
    """The step ended after a collective timeout: requeue to resume from the last checkpoint (exit 0), or say how."""
    log(f"the job step ended after a collective timeout: {_read(record)}")
    if not os.path.exists(os.path.join(run_dir, "checkpoints", "latest")):
        log("no checkpoint to resume from; not requeueing")
    elif resume(run_dir, "", switches, env, "; if a node is faulty, drain it (scontrol update nodename=NODE "
                "state=drain reason=...)"):
        sys.exit(0)


def relaunchable(run_dir: str, command: list[str], step: Step, rc: int, env) -> tuple | None:
    """After a step that lost a rank or host (no record of the ranks', or a collective timeout) and was not
    stopped on purpose: (the command again on the hosts that answer, the hosts left out), else None."""
    if rc == 0 or step.signalled or step.interrupts or rc == 2:
        return None
    timed_out = timeout_record(run_dir, step.started)
    if ending.settle(run_dir, step.started, rc, "the job step") not in (ending.UNRECORDED, "timeout") and not timed_out:
        return None
    log(f"job step exited with status {rc}" + (f" after a collective timeout: {_read(timed_out)}" if timed_out else ""))
    return relaunch.command_again(command, env)


def run(run_dir: str, command: list[str], env, early: list) -> int:
    """The job (see the module); its exit status."""
    switches = Switches.read(env)
    refuse_another_out(run_dir, command)
    try:   # a stop request while the step starts is kept in `early` (the handlers of the module's start)
        step = Step(command, switches)
    except OSError as exc:   # no such launcher (srun, mpirun) on this node's PATH: as a shell says it
        log(f"error: cannot start the job step {command[0]}: {exc.strerror}")
        return 127 if isinstance(exc, FileNotFoundError) else 126
    act = {signal.SIGUSR1: step.stop_requested, signal.SIGINT: step.interrupted}
    for sig in (signal.SIGUSR1, signal.SIGINT) if switches.plain else (signal.SIGUSR1,):
        signal.signal(sig, lambda sig, _: act[sig]())
    while early:
        act[early.pop(0)]()
    rc = step.wait(run_dir)
    for n in range(1, switches.relaunches + 1):   # a lost rank or host: again on the hosts that answer
        if not (again := relaunchable(run_dir, command, step, rc, env)):
            break
        log(f"relaunch {n} of at most {switches.relaunches} (CAPSTONE_MAX_RELAUNCHES): the step lost a rank or host; "
            f"{' '.join(again[0])}" + (f" (without {', '.join(again[1])})" if again[1] else ""))
        step = Step(again[0], switches)
        act.update({signal.SIGUSR1: step.stop_requested, signal.SIGINT: step.interrupted})
        rc = step.wait(run_dir)
    # the time limit's warning can land as the step ends (a requeued job's fresh limit too): not fatal now
    signal.signal(signal.SIGUSR1, lambda *_: log("SIGUSR1 after the job step ended: nothing left to stop"))
    if switches.plain:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    log(f"job step exited with status {rc}")
    if os.environ.get("CAPSTONE_JOB_FAULT") == "usr1-after-step":   # test hook: a real late warning
        os.kill(os.getpid(), signal.SIGUSR1)
    if rc != 0 and (record := timeout_record(run_dir, step.started)):
        after_timeout(run_dir, record, switches, env)
    status = ending.settle(run_dir, step.started, rc, "the job step")
    log(f"summary status: {status or '<no summary.json>'}")
    if rc == 0 and status == "preempted":   # requeued: Slurm ends this run and queues the job again; the next resumes
        resume(run_dir, "checkpointed; ", switches, env)
        return 0
    if rc == 0 and step.signalled and status != "completed":
        log(f"warning: signalled, exit status 0, but summary status is '{status or 'none'}'")
    return rc


def main(argv: list[str], early: list) -> int:
    try:
        if argv[:1] == ["make-run-dir"] and len(argv) == 2:
            make_run_dir(argv[1], os.environ)
            return 0
        if len(argv) < 2:
            raise JobError("usage: python -m capstone.runtime.job RUN_DIR COMMAND... | make-run-dir DIR")
        return run(argv[0], argv[1:], os.environ, early)
    except JobError as exc:
        log(f"error: {exc}")
        return 2
    finally:   # Python puts a handled signal's default action back as it exits: a late warning would kill it
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], _early))
