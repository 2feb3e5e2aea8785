"""capstone: end-to-end training of a GPT on MPI. Data, tensor, pipeline and context parallelism share one
grid, ZeRO stages 0-3 run under each, and a checkpoint is one parallel-HDF5 file with a sha256 per rank.

The top level reads as the path from the flags to the step: `cli` (the flags) -> `plan` (the layout and
every layout refusal) -> `run` (the run's objects, built once) -> `modes` (the plan's transformations of the
one model) -> `train` (the loop), with `config` and `roles` (the parts' Protocols); beside them the commands a user runs without mpirun
(`prepare`, `export`, `sample`, `plot`). The parts live in subpackages: model, parallel, collective,
checkpoint, data, observe, runtime, step, flags, gpt2.

Run as `python -m capstone.<command>` from a Python without capstone's libraries (a shell where the venv is
not active), it says so in one line and how to set up, instead of a ModuleNotFoundError traceback."""

import importlib.util
import os
import sys

__version__ = "0.1.0"
NEEDS = ("numpy", "autograd", "h5py")          # every command (the model, the checkpoints)
NEEDS_MORE = {"capstone.train": ("mpi4py",)}   # and per command


def _missing_libraries() -> None:
    """Under `python -m capstone.X` only (a library import is left to raise as usual): exit 2 with one line."""
    argv = getattr(sys, "orig_argv", [])
    if sys.argv[:1] != ["-m"] or "-m" not in argv[:-1]:
        return
    command = argv[argv.index("-m") + 1]
    missing = [m for m in NEEDS + NEEDS_MORE.get(command, ()) if importlib.util.find_spec(m) is None]
    if not missing:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    venv = os.path.join(root, ".venv")
    todo = (f"`source {venv}/bin/activate` (capstone's venv) and run it again" if os.path.isdir(venv) else
            f"Run {root}/scripts/setup once (it makes {venv}), then `source {venv}/bin/activate`")
    if os.environ.get("SLURM_JOB_ID"):   # a batch script activates $CAPSTONE_VENV (default: the repository's .venv)
        todo = (f"In a batch job: submit with CAPSTONE_VENV=<capstone's venv> set (default {venv}; "
                f"{root}/scripts/setup makes it) and check that every node sees it")
    ranks = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
    if next((os.environ[k] for k in ranks if k in os.environ), "0") == "0":   # once under mpirun and srun
        print(f"error: {sys.executable} has no {', '.join(missing)}: this shell is not in capstone's venv. {todo} "
              f"(scripts/run does both).", file=sys.stderr)
    sys.exit(2)


_missing_libraries()
