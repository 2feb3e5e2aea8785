"""`--init-from SRC`: a new run that starts from another run's weights (fine-tuning).

SRC is a capstone checkpoint (a ckpt-*.h5 file, or a run directory: the checkpoint its `latest`
names; written on any world size or grid: the master row of its canonical vectors, read and verified
as `capstone.sample` reads it) or an export (`python -m capstone.export`: safetensors, GPT-2 names).
Only the weights are taken: Adam's m and v start at zero, the step count and the data are the new
run's. The model's settings are SRC's (a flag that contradicts them is refused), and the new data
must have SRC's vocabulary (the same tokenizer: `prepare --vocab-from`), so that every token id
means what it meant in training; the refusal names what differs.

The training settings (`settings_for`): those of INHERITED come from SRC's run (a checkpoint holds
its TrainConfig), or, for an export, which holds none, from the --preset given (`--preset gpt2` for
GPT-2's weights), else FINETUNE_DEFAULTS (documented in docs/finetune.md); flags override all of
them, and a checkpoint's override a --preset's. A warmup so taken keeps its
share of a shorter run, as a preset's does (capstone.flags.presets.fit_warmup). The start prints the
settings in effect that differ from the preset's.
"""

import dataclasses
import json
import os

import numpy as np

from capstone.flags import paths
from capstone.checkpoint import CheckpointError, CorruptCheckpoint, serial
from capstone.collective.agree import agreed
from capstone.config import ConfigError, ModelConfig, TrainConfig
from capstone.data.tokenizer import difference, from_description
from capstone.model.params import Layout
from capstone.flags.presets import COSINE, fit_warmup
from capstone.step.state import ShardState

# what a fine-tuning run takes from its source run: the optimizer, the schedule, the cadence, the evaluation
INHERITED = ("lr", "lr_schedule", "warmup_steps", "min_lr", "clip", "beta1", "beta2", "eps", "weight_decay",
             "eval_every", "eval_batches", "eval_batch_size", "ckpt_every", "ckpt_every_minutes", "keep_last")
# from an export: settings for a run of FINETUNE_STEPS (the warmup shortened for a shorter one)
FINETUNE_DEFAULTS = {"lr": 3e-4, **COSINE, "warmup_steps": 30, "min_lr": 3e-5, "eval_every": 25, "eval_batches": 4,
                     "eval_batch_size": 8, "ckpt_every": 100}
FINETUNE_STEPS = 300


@dataclasses.dataclass(frozen=True)
class Source:
    """The weights a run starts from, and what they were trained on."""

    path: str              # the file read
    kind: str              # "checkpoint" or "export"
    step: int              # the step of the run that wrote them
    model: ModelConfig
    data: dict             # that run's data identity (capstone.data.open_data; {} if not recorded)
    params: np.ndarray     # flat float32 parameters of the 1-rank layout (n_params)
    train: dict = dataclasses.field(default_factory=dict)   # that run's TrainConfig ({}: an export)

    def install(self, run) -> None:
        """Collective: the source's weights as this rank's optimizer shard (master), Adam's m and v zero
        at step 0, and the parameters published: through the checkpoints' canonical view, so any grid."""
        world, full = run.grid.world, run.ckpt.layout     # the canonical vectors' layout, sharded over the world
        flat = np.zeros(full.padded, dtype=np.float32)
        flat[:self.params.size] = self.params
        lo, hi = full.shard_range(world.rank)
        zeros = np.zeros(hi - lo, dtype=np.float32)
        run.opt.load_state(run.ckpt.view.from_stored(ShardState(flat[lo:hi].copy(), zeros, zeros.copy(), t=0)))

    def describe(self) -> dict:
        return {"path": os.path.abspath(self.path), "kind": self.kind, "step": self.step,
                "model_config": dataclasses.asdict(self.model), "data_digest": self.data.get("digest")}


ACCEPTS = f"--init-from takes {paths.ACCEPTS['--init-from'].long}."   # what its refusals end with
CORRUPT = ("Do not fine-tune from it: pass another checkpoint of that run (python -m capstone.checkpoint verify "
           "RUN_DIR/checkpoints/ckpt-*.h5 says which verify), or restore a good copy.")


def read(target: str, seq_len: int | None = None) -> Source:
    """One process: the weights of a checkpoint, an export or a Hugging Face GPT-2 directory (capstone.gpt2.hf:
    `seq_len` crops its positions). CheckpointError for an invalid file or weights that are not all finite,
    ConfigError for a path that is none."""
    return refuse_non_finite(target, _read(target, seq_len))


def _read(target: str, seq_len: int | None) -> Source:
    found = paths.refuse("--init-from", target)   # ConfigError for a path that holds no weights
    if found is paths.Kind.EXPORT:
        return _read_export(target)
    if found is paths.Kind.HF_MODEL:
        from capstone.gpt2 import hf
        cfg, params, data = hf.read(target, seq_len)
        refuse_unjudged(target, hf.exported_meta(target))
        return Source(target, "export", 0, cfg, data, params)
    try:
        path = serial.find(target, "--init-from")
        meta, cfg, params = serial.load_weights(path)
    except CorruptCheckpoint as exc:   # its advice is a resume's: say what a fine-tuning run does instead
        raise CheckpointError(f"--init-from {target}: not a valid checkpoint: {path}: {exc.reason}. {CORRUPT}") \
            from None
    except (ConfigError, CheckpointError) as exc:   # the class kept: exit 2 for a path, 1 for an invalid file
        raise type(exc)(f"--init-from {target}: {exc}") from None
    refuse_unjudged(target, meta, path)
    return Source(path, "checkpoint", int(meta["step"]), cfg, meta.get("data") or {},
                  params[:Layout.for_model(cfg, 1).n_params], meta.get("train_config") or {})


def refuse_non_finite(target: str, source: Source) -> Source:
    """`source`, or CheckpointError if any weight is NaN or infinite (a diverged run's, or a damaged file's), naming
    the tensors."""
    if np.isfinite(source.params).all():
        return source
    views = Layout.for_model(source.model, 1).views(source.params)   # one rank: no padding
    bad = [name for name, view in views.items() if not np.isfinite(view).all()]
    raise CheckpointError(f"--init-from {target}: {int(np.count_nonzero(~np.isfinite(source.params)))} of its weights "
                          f"are NaN or infinite (in {', '.join(bad[:4])}{' and more' if len(bad) > 4 else ''}): "
                          f"no training can start from them. Pass an earlier checkpoint of that run, saved before "
                          f"it diverged, or export one again.")


def refuse_unjudged(target: str, meta: dict, path: str | None = None) -> None:
    """ConfigError if `meta` (a checkpoint's, judged False; or an export's, "false", naming its checkpoint)
    marks a state the guard never judged."""
    if meta.get("judged", True) not in (False, "false"):
        return
    path = path or meta.get("checkpoint", target)
    raise ConfigError(f"--init-from {target}: {path} was saved by a stop before the divergence guard judged it "
                      f"(no held-out evaluation), so nothing may train from it yet. Resume its run (--out <that run> "
                      f"--resume latest), which judges it before its first step, and export or pass a checkpoint "
                      f"it saves after that; or pass an older checkpoint of that run.")


def _read_export(path: str) -> Source:
    """An export's tensors back into the flat layout (capstone.gpt2.hf.read_file; lm_head.weight transposed back)."""
    from capstone.gpt2.hf import read_file
    from capstone.gpt2.tensors import FORMAT, library
    library(lambda said: ConfigError(f"--init-from {path}: {said}"))   # the library, or the install command

    def config(meta: dict) -> ModelConfig:
        if meta.get("format") != FORMAT:
            raise ConfigError(f"--init-from {path}: not a capstone export (format {meta.get('format')!r}); "
                              f"pass a file `python -m capstone.export` wrote.")
        refuse_unjudged(path, meta)
        return ModelConfig(**json.loads(meta["capstone_model_config"]))
    cfg, params, meta, data = read_file(path, path, config, export=True)
    return Source(path, "export", int(meta.get("step", 0)), cfg, data, params)


def fetch(world, target: str, seq_len: int | None = None) -> Source:
    """Collective: rank 0 reads `target`; every rank gets the Source (or the same error)."""
    found = []   # rank 0's Source, whose weights are broadcast below

    def describe() -> dict:
        found.append(read(target, seq_len))
        return dataclasses.asdict(dataclasses.replace(found[0], params=None))   # the weights: broadcast below
    head = agreed(world, describe, errors=(ConfigError, CheckpointError))
    cfg = ModelConfig(**head["model"])
    params = found[0].params if found else np.empty(Layout.for_model(cfg, 1).n_params, dtype=np.float32)
    world.Bcast(params, "broadcast of the --init-from weights")
    return Source(**{**head, "model": cfg, "params": params})


def settings_for(settings, source: Source):
    """The settings of a run fine-tuned from `source`: its model; the training settings of INHERITED
    from its run (an export: FINETUNE_DEFAULTS) under the flags, the warmup fitted to the run; and the
    start's notes (ConfigError if the flags or the combination are invalid)."""
    if source.kind == "checkpoint":
        taken = {k: source.train[k] for k in INHERITED if k in source.train}
        origin, nominal = f"--init-from {source.path}", source.train.get("steps")
    elif settings.preset:   # an export holds no training settings: a --preset given says them (e.g. gpt2's)
        taken, origin, nominal = {}, f"--preset {settings.preset}", None
    else:
        taken, origin, nominal = dict(FINETUNE_DEFAULTS), "the fine-tuning defaults", FINETUNE_STEPS
    if "lr" in settings.flags and "min_lr" not in settings.flags and taken.get("lr"):   # the schedule's shape
        taken["min_lr"] = settings.flags["lr"] * taken.get("min_lr", 0.0) / taken["lr"]
    preset = dataclasses.asdict(TrainConfig())
    preset.update((k, v) for k, v in settings.preset_values.items() if k in preset)   # its model's are model_for's
    values, fitted = fit_warmup({**preset, **taken, **settings.flags}, settings.flags, nominal, origin)
    train = TrainConfig(**{k: values[k] for k in preset})
    differ = [f"{k} {getattr(train, k)!r}{' (flag)' if k in settings.flags else ''}" for k in INHERITED
              if getattr(train, k) != preset[k]]
    where = "its run" if source.kind == "checkpoint" else f"{origin} (an export holds none)"
    note = (f"note: fine-tuning with the training settings of {where} unless a flag sets them: in effect, apart "
            f"from --preset {settings.preset or 'reference'}'s: {', '.join(differ) or 'none'} (docs/finetune.md)")
    return dataclasses.replace(settings, model=model_for(settings, source), train=train,
                               notes=(note,) + ((fitted,) if fitted else ()))


def flag(key: str, value) -> str:
    """A model setting as its flag: `--d-model 32`, `--tie-embeddings` / `--no-tie-embeddings`."""
    name = key.replace("_", "-")
    return f"--{'' if value else 'no-'}{name}" if isinstance(value, bool) else f"--{name} {value}"


def model_for(settings, source: Source) -> ModelConfig:
    """The source's model config; ConfigError if a flag (or --preset) asks for another."""
    want = dataclasses.asdict(source.model)
    differ = [f"{flag(k, settings.explicit[k])} (it has {flag(k, want[k]) if isinstance(want[k], bool) else want[k]})"
              for k in want if k in settings.explicit and settings.explicit[k] != want[k] and k != "dropout"]
    if differ:
        raise ConfigError(f"--init-from {source.path}: the model comes from it, but {', '.join(differ)} asks for "
                          f"another. Drop those flags (and a --preset that sets them): a fine-tuned model keeps "
                          f"its shape.")
    return dataclasses.replace(source.model, dropout=settings.explicit.get("dropout", source.model.dropout))


def check_vocabulary(source: Source, data: dict, data_dir: str) -> None:
    """ConfigError unless the new data's token ids mean what they meant for the source (`data`: the
    new run's data identity: capstone.data.dataset.identity, or the synthetic corpus')."""
    mine, theirs = source.data.get("tokenizer"), data.get("tokenizer")
    from capstone.gpt2 import hf
    # a Hugging Face GPT-2 directory that capstone's export did not write: its tokenizer is vocab.json + merges.txt
    gpt2 = paths.kind(source.path) is paths.Kind.HF_MODEL and not hf.exported(source.path)
    fix = ("Prepare the new text with its GPT-2 tokenizer: python -m capstone.prepare TEXT --out DIR "
           f"--tokenizer-from {source.path}." if gpt2 and mine is not None else
           "Prepare the new text with the source's vocabulary: python -m capstone.prepare TEXT --out DIR "
           "--vocab-from <the source run's dataset directory>.")
    if mine is None and theirs is None:
        return   # both the synthetic corpus: ids are ids
    if mine is None and gpt2:
        raise ConfigError(f"--init-from {source.path}: it holds no tokenizer (no vocab.json + merges.txt beside "
                          f"config.json), so the ids of --data {data_dir} would mean other things. Put the model's "
                          f"GPT-2 vocab.json and merges.txt in {source.path} and prepare the text with "
                          f"python -m capstone.prepare TEXT --out DIR --tokenizer-from {source.path}, or drop "
                          f"--data to train on the synthetic corpus.")
    if mine is None or theirs is None:
        which = "the synthetic corpus" if mine is None else f"text ({from_description(mine).kind} tokens)"
        new = "the synthetic corpus (no --data)" if theirs is None else f"the text of --data {data_dir}"
        other = (f"Pass --data with a text prepared with prepare --tokenizer-from {source.path}." if gpt2 else
                 "Pass --data with the dataset it was trained on, or one prepared with prepare --vocab-from that "
                 "dataset.")
        raise ConfigError(f"--init-from {source.path}: it was trained on {which}, this run on {new}: the token ids "
                          f"would mean other things. " + (fix if theirs is not None else other))
    diff = difference(from_description(mine), from_description(theirs), ("the --init-from model's", "--data's"))
    if diff:
        raise ConfigError(f"--init-from {source.path}: the vocabularies differ: {diff}. The token ids would mean "
                          f"other characters. {fix}")
