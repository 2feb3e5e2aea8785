"""Relaunching a job step that lost a rank or a host on the hosts still reachable (capstone.runtime.job).

A step launched with `--resume auto` that ended without the ranks' record (a lost rank or host: mpirun
ended the others) or after a collective timeout (a silent host) is started again, up to
CAPSTONE_MAX_RELAUNCHES times (default 3 under scripts/launch; 0 in a batch job, where a lost node ends the
job unless it was submitted with `sbatch --no-kill`), on the hosts that answer now:
- mpirun (`-H`/`--host`, or scripts/hosts' `--hosts` list HOST:SLOTS,...): each host of the first launch's
  list is probed with CAPSTONE_HOST_PROBE ("{host}" replaced; default `ssh -o BatchMode=yes -o
  ConnectTimeout=5 {host} true`, mpirun's own way in) and the list and `-n` become those that answered;
- srun (inside the batch job's allocation, submitted with `sbatch --no-kill` so that a lost node does not
  end it): each node of the allocation is probed with a one-task `srun` on it, and the step runs with
  `--exclude` of those that did not answer, on as many ranks per node as before (and `--overlap`: the lost
  step holds its CPUs until Slurm has given up on the lost node).
A host that answers again is taken back at the next relaunch. The ranks then resume from the newest state
the nodes left hold (capstone.checkpoint.recover) or from the disk, with the same global batch.
"""

import contextlib
import os
import re
import shlex
import subprocess

SSH = "ssh -o BatchMode=yes -o ConnectTimeout=5 {host} true"
ONE_TASK = "--nodes=1 --ntasks=1 --overlap true"   # srun's probe of a node


def answers(probe: str, host: str, timeout: float = 15) -> bool:
    """Whether `probe` (a command line with {host}) succeeds on `host` in time."""
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        return subprocess.run(shlex.split(probe.format(host=host)), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout).returncode == 0
    return False


def host_list(command: list[str]) -> tuple[int, list[tuple[str, int]]] | None:
    """(index of the value, [(host, slots)]) of an mpirun host list in `command`, or None."""
    for i, arg in enumerate(command[:-1]):
        if arg in ("-H", "--host", "--hosts"):   # mpirun's; scripts/hosts mpirun's
            return i + 1, [(h, int(n) if n else 1) for h, _, n in (x.partition(":") for x in command[i + 1].split(","))]
    return None


def mpirun_command(command: list[str], env) -> tuple[list[str], list[str]] | None:
    """(the command on the hosts that answer, the hosts left out), or None if there is no list or none answers."""
    if (found := host_list(command)) is None:
        return None
    at, hosts = found
    if not (alive := [(h, n) for h, n in hosts if answers(env.get("CAPSTONE_HOST_PROBE") or SSH, h)]):
        return None
    out = list(command)
    out[at] = ",".join(f"{h}:{n}" for h, n in alive)
    for i in (i for i, arg in enumerate(out[:-1]) if arg in ("-n", "-np", "--np")):   # as many ranks as slots
        out[i + 1] = str(sum(n for _, n in alive))
    return out, [h for h, _ in hosts if h not in dict(alive)]


def srun_command(command: list[str], env) -> tuple[list[str], list[str]] | None:
    """The srun step again inside the allocation, without the nodes that do not answer (None: none does)."""
    nodes = subprocess.run(["scontrol", "show", "hostnames", env.get("SLURM_JOB_NODELIST", "")], capture_output=True,
                           text=True).stdout.split()
    tasks = int(env.get("SLURM_NTASKS", "1")) // max(1, len(nodes))
    per_node = int(env.get("CAPSTONE_TASKS_PER_NODE") or 0) or max(1, tasks)
    if not (alive := [n for n in nodes if answers(f"srun --nodelist={{host}} {ONE_TASK}", n)]):
        return None
    lost = [n for n in nodes if n not in alive]
    keep = [a for a in command[1:] if not re.match(r"--(nodes|ntasks|ntasks-per-node|exclude|nodelist)=|--overlap$", a)]
    return [command[0], "--overlap", f"--nodes={len(alive)}", f"--ntasks={len(alive) * per_node}",
            f"--ntasks-per-node={per_node}", *([f"--exclude={','.join(lost)}"] if lost else []), *keep], lost


def command_again(command: list[str], env) -> tuple[list[str], list[str]] | None:
    """The step's command for a relaunch on the hosts that answer, and the hosts left out; None: not possible."""
    if not any(a == "--resume=auto" or (a, b) == ("--resume", "auto") for a, b in zip(command, command[1:] + [""])):
        return None
    return (srun_command if os.path.basename(command[0]) == "srun" else mpirun_command)(command, env)
