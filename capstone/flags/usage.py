"""Usage mistakes on `python -m capstone.train`'s command line: each named by its flag, all reported at once.

`unknown` turns argparse's leftovers into sentences that say what to pass instead: the flag with
dashes for underscores, nanoGPT's (and Hugging Face Trainer's) names for capstone's settings
(`--max-iters` -> `--steps`), or the closest flag there is. `option_problems` checks the run
options that no config dataclass validates (`checked`: a table of checks, the plan's too); `as_flag`
names a config field's problem by its flag.
"""

import argparse
import difflib

# Other trainers' flag names (dashes for underscores) -> what capstone.train takes instead.
OTHER_NAMES = {
    "--max-iters": "--steps", "--learning-rate": "--lr", "--warmup-iters": "--warmup-steps",
    "--lr-decay-iters": "--steps (with --lr-schedule cosine the decay spans the run)",
    "--decay-lr": "--lr-schedule cosine", "--eval-interval": "--eval-every", "--eval-iters": "--eval-batches",
    "--n-embd": "--d-model", "--block-size": "--seq-len", "--gradient-accumulation-steps": "--grad-accum",
    "--grad-clip": "--clip", "--out-dir": "--out", "--output-dir": "--out", "--dataset": "--data",
    "--log-interval": "--log-every", "--always-save-checkpoint": "--ckpt-every K", "--wandb-log": "--tensorboard DIR",
    "--num-train-epochs": "--steps", "--per-device-train-batch-size": "--batch-size",
    "--resume-from-checkpoint": "--resume", "--max-steps": "--steps", "--warmup-ratio": "--warmup-steps",
}
# Slurm's options given after the batch script (`sbatch capstone.sbatch --ntasks=2`) reach capstone.train.
SBATCH_OPTIONS = {"--nodes", "--ntasks", "--ntasks-per-node", "--cpus-per-task", "--time", "--partition", "--account",
                  "--qos", "--mem", "--mem-per-cpu", "--exclusive", "--signal", "--requeue", "--job-name", "--output",
                  "--error", "--gres", "--constraint", "--exclude", "--nodelist", "--dependency", "--array"}
NOT_HERE = {"--compile": "NumPy has nothing to compile",
            "--device": "capstone runs on CPUs under MPI (ranks: mpirun -n N)", "--dtype": "it trains in float32"}


def _one(flag: str, value: str | None, known: list[str]) -> str:
    name, eq, after = flag.partition("=")
    dashed = "--" + name.lstrip("-").replace("_", "-")
    value, given = (after, flag) if eq else (value, flag if value is None else f"{flag} {value}")
    if dashed == "--init-from" and value == "resume":
        return f"{given}: nanoGPT's init_from=resume is --resume latest here (--init-from starts a new run)."
    if dashed in known:
        return f"{given}: flags are spelled with dashes: {dashed}{'' if value is None else ' ' + value}."
    if dashed in OTHER_NAMES:
        return f"{given}: unknown flag; did you mean {OTHER_NAMES[dashed]}? ({name} is nanoGPT's or Hugging Face's name)"
    if dashed in SBATCH_OPTIONS:
        return (f"{given}: unknown flag: an sbatch option, which sbatch takes before the script: sbatch {given} "
                f"scripts/slurm/capstone.sbatch [capstone.train flags].")
    if dashed in NOT_HERE:
        return f"{given}: unknown flag: {NOT_HERE[dashed]}."
    close = difflib.get_close_matches(dashed, known, n=1, cutoff=0.7)
    return f"{given}: unknown flag{f'; did you mean {close[0]}?' if close else '.'}"


def unknown(extras: list[str], known: list[str]) -> list[str]:
    """A sentence for each unrecognized flag (with the value after it) or stray argument in `extras`."""
    out, rest = [], list(extras)
    while rest:
        token = rest.pop(0)
        if token.startswith("-"):   # with the value after it, if that is no flag
            value = rest.pop(0) if "=" not in token and rest and not rest[0].startswith("--") else None
            out.append(_one(token, value, known))
        else:
            hint = " (a config file? capstone takes flags and --preset NAME)" if token.endswith(".py") else ""
            out.append(f"{token}: unexpected argument{hint}; every setting is a flag.")
    return out


def as_flag(problem: str, fields: set[str]) -> str:
    """A config problem ("warmup_steps 50 is longer ...") named by its flag ("--warmup-steps 50 is longer ...")."""
    head, sep, rest = problem.partition(" ")
    return f"--{head.replace('_', '-')}{sep}{rest}" if head in fields else problem


def checked(values: dict, checks) -> list[str]:
    """A sentence for each flag among the parsed `values` that fails its row (name, ok, text) of `checks`."""
    return [f"--{name.replace('_', '-')} {text}, got {values[name]!r}." for name, ok, text in checks
            if values.get(name) is not None and not ok(values[name])]


def option_problems(values: dict) -> list[str]:
    """The run options' own checks (the configs and the plan check theirs), one sentence per bad flag."""
    problems = checked(values, [(name, lambda v: v >= 0, f"must be >= 0{unit}") for name, unit in (
        ("stop_after", " (0: off)"), ("sleep_per_step", " seconds"), ("log_every", " (0: automatic, 1: every step)"),
        ("collective_timeout", " seconds (0: automatic)"))])
    if values.get("out") == "":
        problems.append("--out is empty (an unset shell variable?): pass the run directory, or leave --out out for a "
                        "new runs/run-<time>.")
    elif values.get("resume") in ("latest", "auto") and not values.get("out"):
        problems.append(f"--resume {values['resume']} continues the run in --out, and no --out was given (without one "
                        "each launch starts in a new directory, which holds no checkpoint): pass --out RUN_DIR, or "
                        "--resume a run directory or ckpt-*.h5 path.")
    return problems


# ---- the argument types of the test hooks and --pp-layers ----

def step_pair(kind, default: str, example: str):
    """The argument type STEP[:X] -> (int STEP, kind(X or default)), refusing with `example`."""
    def parse(text: str):
        step, _, rest = text.partition(":")
        try:
            return int(step), kind(rest or default)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}") from None
    return parse


spike = step_pair(float, "", "STEP:MULT like 12:1000")                  # --inject-lr-spike
nan_at = step_pair(int, "1", "STEP or STEP:COUNT like 7 or 7:3")        # --inject-nan
from_step = step_pair(int, "0", "STEP or STEP:COUNT like 5 or 5:3")     # --inject-grad-sign, --inject-no-update


def counts(text: str) -> tuple[int, ...] | None:
    if text == "balanced":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected block counts like 3,3,2, got {text!r}") from None
