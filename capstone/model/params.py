"""The flat parameter buffer: one contiguous, padded float32 vector whose views are the model's arrays
(docs/design.md, "Inside the step", model/params.py)."""

import functools
import json
import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from capstone.config import ModelConfig

DTYPE = np.float32

TP_PLAN = MappingProxyType({"attn.c_attn.w": "heads", "attn.c_attn.b": "heads", "attn.c_proj.w": "rows",
                            "mlp.c_fc.w": "columns", "mlp.c_fc.b": "columns", "mlp.c_proj.w": "rows"})


def tp_split(name: str) -> str | None:
    """How tensor parallelism splits parameter `name` (TP_PLAN), None: whole on every tp rank."""
    top, _, rest = name.partition(".")
    return TP_PLAN.get(rest) if top.startswith("h") else None


def is_split(name: str) -> bool:
    """Whether tensor parallelism splits parameter `name` (else every tp rank holds it whole)."""
    return tp_split(name) is not None


def param_shapes(cfg: ModelConfig, tp: int = 1, absent: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter in buffer order, weights (in, out); on one of `tp` ranks, TP_PLAN's splits
    divided by tp. --no-bias: no biases but lm_head.b, with shape None if `absent` (blocks unpack by position)."""
    V, T, C = cfg.vocab_size, cfg.seq_len, cfg.d_model
    shapes = [("wte", (V, C)), ("wpe", (T, C))]
    for i in range(cfg.n_layers):
        shapes += [(f"h{i}.{name}", shape) for name, shape in (
            ("ln_1.w", (C,)), ("ln_1.b", (C,)), ("attn.c_attn.w", (C, 3 * C)), ("attn.c_attn.b", (3 * C,)),
            ("attn.c_proj.w", (C, C)), ("attn.c_proj.b", (C,)), ("ln_2.w", (C,)), ("ln_2.b", (C,)),
            ("mlp.c_fc.w", (C, 4 * C)), ("mlp.c_fc.b", (4 * C,)), ("mlp.c_proj.w", (4 * C, C)), ("mlp.c_proj.b", (C,)))]
    shapes += [("ln_f.w", (C,)), ("ln_f.b", (C,))] + [("lm_head.w", (C, V))] * (not cfg.tie_embeddings)
    shapes += [("lm_head.b", (V,))] * cfg.head_bias      # tied: the head is wte (capstone.model.tied)
    if not cfg.bias:
        shapes = [(name, None if name.endswith(".b") and name != "lm_head.b" else shape) for name, shape in shapes]
    return [(name, _split_shape(shape, tp_split(name), tp)) for name, shape in shapes if absent or shape is not None]


def _split_shape(shape: tuple, split: str | None, tp: int) -> tuple:
    """A tensor-parallel rank's shape of a whole `shape` split as `split` over tp ranks."""
    if split is None or tp == 1 or shape is None:
        return shape
    return (shape[0] // tp,) + shape[1:] if split == "rows" else shape[:-1] + (shape[-1] // tp,)


def group_of(name: str) -> str:
    """The parameter group of a named array: "embed" (wte, wpe), "h<i>" (block i), "head" (ln_f, lm_head)."""
    top = name.split(".")[0]
    return "embed" if top in ("wte", "wpe") else "head" if top in ("ln_f", "lm_head") else top


@functools.lru_cache(maxsize=16)
def group_shapes(cfg: ModelConfig, tp: int = 1) -> dict[str, tuple]:
    """Each group's array shapes in buffer order (what capstone.model.blocks unpacks; None: no bias)."""
    out: dict[str, tuple] = {}
    for name, shape in param_shapes(cfg, tp, absent=True):
        out[group_of(name)] = out.get(group_of(name), ()) + (shape if shape is None else tuple(shape),)
    return out


@dataclass(frozen=True)
class Layout:
    """Offsets of named arrays in a flat buffer of `n_params` values padded to `padded` (a multiple of world)."""

    entries: tuple[tuple[str, tuple[int, ...], int], ...]  # (name, shape, offset)
    n_params: int
    world: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, world: int, tp: int = 1, groups: tuple | None = None) -> "Layout":
        """The layout of (a tp rank's part of) the model padded for `world` ranks; `groups`: only these (a stage's)."""
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        entries, offset = [], 0
        for name, shape in param_shapes(cfg, tp):
            if groups is None or group_of(name) in groups:
                entries.append((name, tuple(shape), offset))
                offset += math.prod(shape)
        return cls(tuple(entries), offset, world)

    @property
    def padded(self) -> int:
        """Buffer length: n_params rounded up to a multiple of the world size."""
        return -(-self.n_params // self.world) * self.world

    @property
    def shard(self) -> int:
        """Elements per rank in ZeRO-1 (padded / world)."""
        return self.padded // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the flat buffer owned by `rank`."""
        return rank * self.shard, (rank + 1) * self.shard

    def _check(self, flat: np.ndarray) -> None:
        if flat.shape != (self.padded,):
            raise ValueError(f"flat buffer has shape {flat.shape}, layout needs ({self.padded},)")

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Named arrays that are views into `flat` (writes go straight into the buffer)."""
        self._check(flat)
        return {name: flat[off:off + math.prod(shape)].reshape(shape) for name, shape, off in self.entries}

    def group_ranges(self) -> dict[str, tuple[int, int]]:
        """[start, end) of each parameter group in the flat buffer, in order (`group_of`)."""
        ranges: dict[str, tuple[int, int]] = {}
        for name, shape, off in self.entries:       # a group's start: its first array's offset
            ranges[group_of(name)] = (ranges.get(group_of(name), (off,))[0], off + math.prod(shape))
        return ranges

    def groups(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The model's inputs: each group as a 1-D view into `flat` (capstone.model.blocks)."""
        self._check(flat)
        return {g: flat[a:b] for g, (a, b) in self.group_ranges().items()}

    def zeros(self) -> np.ndarray:
        return np.zeros(self.padded, dtype=DTYPE)

    def to_json(self) -> str:
        """Canonical description (names, shapes, offsets, sizes) stored in checkpoints."""
        return json.dumps({"n_params": self.n_params, "entries": [[n, list(s), o] for n, s, o in self.entries]},
                          sort_keys=True)


def init_params(layout: Layout, cfg: ModelConfig, seed: int, part=None) -> np.ndarray:
    """GPT-2 initialisation into a fresh flat buffer (N(0, 0.02) weights, residual projections /sqrt(2L), zero biases,
    unit LayerNorms; deterministic in `seed`); `part(name, whole)`: a rank's part of each array (parallel.tensor)."""
    flat = layout.zeros()
    views, rng = layout.views(flat), np.random.default_rng(seed)
    for name, shape in [(n, s) for n, s in param_shapes(cfg) if not n.endswith(".b")]:   # biases start at zero
        std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith("c_proj.w") else 0.02
        unit = ".ln_" in name or name.startswith("ln_")
        whole = np.ones(shape, DTYPE) if unit else rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if name in views:
            views[name][...] = whole if part is None else part(name, whole)
    return flat


def no_decay_runs(layout: Layout, lo: int, hi: int, chunk: int) -> list[list[slice]]:
    """Per `chunk`-element pass over the shard [lo, hi): its slices without decay (biases, LayerNorms, padding)."""
    decays = np.zeros(hi - lo + 2, dtype=np.int8)   # 1 where decay applies, 0-padded ends
    for _, shape, off in layout.entries:
        a, b = max(off, lo), min(off + math.prod(shape), hi)
        if len(shape) >= 2 and a < b:
            decays[1 + a - lo:1 + b - lo] = 1
    # [start, end) of the runs without decay: 0, the decaying runs' edges (their starts and ends, in turn), hi - lo
    runs = np.concatenate(([0], np.flatnonzero(np.diff(decays)), [hi - lo])).reshape(-1, 2).tolist()
    return [[slice(max(a, c) - c, min(b, d) - c) for a, b in runs if max(a, c) < min(b, d)]
            for c in range(0, hi - lo, chunk) for d in (min(c + chunk, hi - lo),)]
