"""What a run does besides training, as the command line gives it: where it writes, what it resumes
or starts from, and the test hooks. The model is capstone.config's, how the run is laid out on its
ranks is its plan's (capstone.plan)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    """What a run does besides training: where it writes, resumes from, and test hooks (how it is laid
    out on its ranks is its plan's: capstone.plan)."""

    out: str | None = None
    resume: str | None = None
    stop_after: int = 0
    sleep_per_step: float = 0.0
    inject_lr_spike: tuple[int, float] | None = None
    inject_nan: tuple[int, int] | None = None
    quiet: bool = False
    log_every: int = 0                   # console row every K steps (0: 1 up to 100 steps, else about steps/50)
    tensorboard: str | None = None       # also write TensorBoard scalars to this directory
    collective_timeout: float = 0.0   # seconds; 0: automatic (capstone.collective.deadline)
    inject_grad_sign: tuple[int, int] | None = None   # test hook: negate the gradient from STEP for COUNT steps
    inject_no_update: tuple[int, int] | None = None   # test hook: zero the gradient from STEP for COUNT steps
    init_from: str | None = None      # start a new run from these weights (capstone.gpt2.finetune)
