"""Configuration: frozen, validated dataclasses for the model and the training run."""

import dataclasses
import math


class ConfigError(ValueError):
    """A configuration value is invalid; the message says what to change (`problems`: each mistake's own sentence)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


def problems_error(problems: list[str]) -> ConfigError:
    """One ConfigError naming every problem: the sentence itself, or "N problems: (1) ... (2) ..."."""
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError(f"{len(problems)} problems: " + " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)),
                       problems)


class _Checks:
    """`require(ok, message)` per check (one problem per field: its messages start with its name); `done()` raises."""

    def __init__(self):
        self.failed: list[str] = []

    def __call__(self, ok: bool, message: str) -> None:
        if not ok and not any(f.split(" ", 1)[0] == message.split(" ", 1)[0] for f in self.failed):
            self.failed.append(message)

    def done(self) -> None:
        if self.failed:
            raise problems_error(self.failed)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """MiniGPT dimensions (GPT-2 names: V vocab, T context, C width, H heads, L blocks) and GPT-2's options."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    bias: bool = True              # biases in the blocks and every LayerNorm (nanoGPT's bias=False: --no-bias)
    head_bias: bool = True         # the LM head has a bias (GPT-2's has none: --no-head-bias)
    tie_embeddings: bool = False   # the LM head is wte (capstone.model.tied)
    dropout: float = 0.0           # GPT-2's dropout while training (capstone.model.dropout)

    def __post_init__(self):
        _require = _Checks()
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
            _require(isinstance(value := getattr(self, name), int) and value >= 1,
                     f"{name} must be a positive integer, got {value!r}; pass e.g. --{name.replace('_', '-')} 4.")
        for name in ("bias", "head_bias", "tie_embeddings"):
            _require(isinstance(value := getattr(self, name), bool), f"{name} must be true or false, got {value!r}.")
        _require(type(self.dropout) in (int, float) and 0 <= self.dropout < 1, f"dropout must be in [0, 1), got "
                 f"{self.dropout!r}; GPT-2 trained with --dropout 0.1.")
        if not _require.failed:   # the checks between fields, once each field is valid
            hint = max(h for h in range(1, self.n_heads + 1) if self.d_model % h == 0)
            _require(self.d_model % self.n_heads == 0, f"d_model ({self.d_model}) must be divisible by n_heads "
                     f"({self.n_heads}): each head gets d_model/n_heads channels. Choose e.g. --d-model "
                     f"{self.n_heads * max(1, self.d_model // self.n_heads)} or --n-heads {hint}.")
            _require(self.vocab_size >= 2, f"vocab_size must be at least 2, got {self.vocab_size}.")
            _require(self.vocab_size <= 2**31 - 1, f"vocab_size {self.vocab_size} does not fit int32 token ids.")
        _require.done()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, data and schedule settings of one run (batch is sequences per rank per micro-batch)."""

    seed: int = 1234
    steps: int = 20
    batch_size: int = 4
    global_batch: int = 0          # sequences per step over all ranks; if set, fixes batch_size per world size
    grad_accum: int = 1
    lr: float = 1e-2
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float = 0.0
    data: str = ""                 # a directory made by capstone.prepare; "" for the synthetic corpus
    corpus_tokens: int = 1 << 18
    corpus_seed: int = 0
    eval_every: int = 1
    eval_batches: int = 1
    eval_batch_size: int = 32
    ckpt_every: int = 10
    ckpt_every_minutes: float = 30.0
    memory_tier: int = 0           # every K-th step in the nodes' memory, a copy on another node (checkpoint.tier)
    keep_last: int = 3
    spike_factor: float = 2.0
    max_rollbacks: int = 3
    loss_tol: float = 1e-4
    loss_tol_rel: float = 0.05
    deterministic: bool = False    # fixed-order reductions: bit-identical for any ranks x grad_accum (capstone.parallel.deterministic)
    keep_best: bool = False        # also checkpoint each new best held-out loss (capstone.checkpoint.best)

    def for_replicas(self, replicas: int) -> "TrainConfig":
        """These settings with grad_accum 0 (from the global batch, keeping batch_size: a resume onto fewer ranks
        accumulates more) made the number of micro-batches on `replicas` data-parallel replicas."""
        accum, rest = divmod(self.global_batch, replicas * self.batch_size)
        if not self.grad_accum and (rest or not accum):
            raise ConfigError(f"--grad-accum 0: the global batch {self.global_batch} is not a multiple of {replicas} "
                              f"data-parallel replicas x --batch-size {self.batch_size}; pass a --batch-size or a "
                              f"--global-batch that makes it one, or --grad-accum N.")
        return self if self.grad_accum else dataclasses.replace(self, grad_accum=accum)

    def batch_for(self, world: int) -> int:
        """Sequences per rank per micro-batch on `world` ranks (from global_batch when it is set)."""
        if not self.global_batch:
            return self.batch_size
        per = self.global_batch // (world * self.grad_accum)
        if per * world * self.grad_accum != self.global_batch:
            raise ConfigError(f"global_batch {self.global_batch} is not divisible by {world} ranks x grad_accum "
                              f"{self.grad_accum}; choose a world size or --grad-accum that divides it, or "
                              f"--global-batch 0.")
        return per

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (1-based) under this run's schedule."""
        return learning_rate(step, self.lr, self.steps, self.lr_schedule, self.warmup_steps, self.min_lr)

    def __post_init__(self):
        _require = _Checks()
        for name in ("steps", "batch_size", "max_rollbacks", "eval_every", "eval_batches", "eval_batch_size"):
            _require(isinstance(value := getattr(self, name), int) and value >= 1,
                     f"{name} must be a positive integer, got {value!r}; pass e.g. --{name.replace('_', '-')} 1.")
        _require(isinstance(self.corpus_tokens, int) and self.corpus_tokens >= 2,
                 f"corpus_tokens must be an integer >= 2, got {self.corpus_tokens!r}; the default is {1 << 18}.")
        for name in ("warmup_steps", "ckpt_every", "keep_last", "seed", "corpus_seed", "global_batch", "grad_accum",
                     "memory_tier"):
            _require(isinstance(value := getattr(self, name), int) and value >= 0,
                     f"{name} must be an integer >= 0, got {value!r}{'' if 'seed' in name else ' (0: off)'}.")
        for f in dataclasses.fields(self):
            if isinstance(value := getattr(self, f.name), float):
                _require(math.isfinite(value), f"{f.name} must be a finite number, got {value}.")
        _require(self.lr > 0, f"lr must be > 0, got {self.lr}; the reference uses --lr 1e-2.")
        _require(self.lr_schedule in ("constant", "cosine"),
                 f"lr_schedule must be 'constant' or 'cosine', got {self.lr_schedule!r}.")
        for name in ("beta1", "beta2"):
            _require(0 <= (value := getattr(self, name)) < 1, f"{name} must be in [0, 1), got {value}.")
        _require(self.eps > 0, f"eps must be > 0, got {self.eps}.")
        for name in ("weight_decay", "clip", "ckpt_every_minutes", "loss_tol"):   # clip, ckpt_every_minutes: 0 is off
            _require((value := getattr(self, name)) >= 0, f"{name} must be >= 0, got {value}.")
        _require(self.spike_factor > 1, f"spike_factor must be > 1, got {self.spike_factor}; the default is 2.")
        _require(0 <= self.loss_tol_rel < 1, f"loss_tol_rel must be in [0, 1), got {self.loss_tol_rel}.")
        if not _require.failed:   # the checks between fields, once each field is valid
            _require(self.grad_accum or self.global_batch, "grad_accum 0 derives the accumulation from the global "
                     "batch: pass --global-batch G with it (G / (replicas x --batch-size) micro-batches a step).")
            _require(0 <= self.min_lr <= self.lr, f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}.")
            _require(self.warmup_steps <= self.steps, f"warmup_steps {self.warmup_steps} is longer than steps "
                     f"{self.steps}: the learning rate would still be rising at the last step and never reach its "
                     f"peak lr {self.lr}. Pass --warmup-steps {self.steps} or fewer (a tenth of the run is common: "
                     f"--warmup-steps {max(1, self.steps // 10)}), or more --steps.")
        _require.done()


def learning_rate(step: int, lr: float, steps: int, kind: str = "constant", warmup: int = 0, min_lr: float = 0.0) -> float:
    """Linear warmup, then constant or cosine decay towards min_lr, reached one step after the last."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if kind == "constant":
        return lr
    progress = min(1.0, (step - warmup - 1) / max(1, steps - warmup))   # cosine (TrainConfig checks the kind)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
