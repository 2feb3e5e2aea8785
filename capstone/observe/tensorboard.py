"""`--tensorboard DIR`: the step rows as TensorBoard scalars, written by rank 0.

Optional: training needs no TensorBoard. The writer comes from tensorboardX, else from
torch.utils.tensorboard; with neither, the run stops before its first step with exit status 2 and
the install command, before anything is written. metrics.jsonl stays the record; this is a view of the same numbers.
"""

import contextlib
import importlib

from capstone.collective.agree import agreed
from capstone.config import ConfigError
from capstone.observe.runlog import number, timing_parts

INSTALL = ("pip install tensorboardX   (the writer; or torch, for torch.utils.tensorboard); "
           "to look: pip install tensorboard && tensorboard --logdir DIR")
SCALARS = {"loss": "train/loss", "eval_loss": "eval/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "param_norm": "train/param_norm", "tokens_per_s": "perf/tokens_per_s", "step_ms": "perf/step_ms",
           "tokens_total": "perf/tokens_total"}


def writer_class():
    """SummaryWriter of tensorboardX or torch.utils.tensorboard, or None."""
    for module in ("tensorboardX", "torch.utils.tensorboard"):
        with contextlib.suppress(ImportError):
            return importlib.import_module(module).SummaryWriter
    return None


class Board:
    """Scalars of each step row: SCALARS, each phase's ms (time/<phase>_ms) and each collective's
    bandwidth (comm/<name>_busbw_GBps, comm/<name>_algbw_GBps), at the row's wall-clock time."""

    def __init__(self, logdir: str):
        self.writer = writer_class()(logdir)

    def write(self, row: dict) -> None:
        scalars = {tag: number(row.get(key)) for key, tag in SCALARS.items()}
        scalars.update({f"time/{phase}_ms": ms for phase, ms in timing_parts(row).items()})
        scalars.update({f"comm/{name}_{key}": number(e.get(key)) for name, e in (row.get("comm") or {}).items()
                        for key in ("algbw_GBps", "busbw_GBps")})
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, row["step"], walltime=row.get("time"))

    def close(self) -> None:
        self.writer.close()


def check_writer(comm) -> None:
    """Collective: call on all ranks, before the run directory is made. ConfigError on every rank
    when rank 0 has no writer."""
    def check() -> None:
        if writer_class() is None:
            raise ConfigError(f"--tensorboard needs tensorboardX (or torch) installed: {INSTALL}. Or leave out "
                              "--tensorboard: metrics.jsonl has the same numbers (python -m capstone.plot).")
    agreed(comm, check, errors=(ConfigError,))
