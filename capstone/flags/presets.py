"""Named settings (`--preset NAME`): plain data, overridden by any flag given explicitly.

`reference` is the product's experiment (every default). `shakespeare-char` is nanoGPT's CPU
"baby GPT" on character-level Shakespeare (its model: no biases, the head tied to wte); `medium` and `large` are sizes where speed matters
(docs/performance.md measures them). `gpt2` is GPT-2 small's shape (124M parameters: tied head, no
head bias, 1024 positions, its 50257 BPE tokens) for fine-tuning GPT-2 weights on CPU ranks
(`--init-from DIR`, with `--zero-stage 3 --recompute`: docs/gpt2.md); `gpt2-mini` the same model
family at 4 blocks of width 256 and 256 positions (16.1M parameters), to try the route quickly.

A warmup that comes from a preset (or, fine-tuning, from the source run) keeps its share of the run
when the run is shorter than the one it was set for (`fit_warmup`): `--preset medium --steps 6`
warms up for 1 step, not 40; an explicit `--warmup-steps` is taken as given.
"""

import math

from capstone.config import ConfigError

# the optimizer and schedule of the cosine presets (nanoGPT's baby GPT's)
COSINE = {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "clip": 1.0, "lr_schedule": "cosine"}
PRESETS: dict[str, dict] = {
    "reference": {},
    "shakespeare-char": {"n_layers": 4, "n_heads": 4, "d_model": 128, "seq_len": 64, "bias": False, "head_bias": False,
                         "tie_embeddings": True, "data": "data/shakespeare", "global_batch": 12, "steps": 2000,
                         "lr": 1e-3, **COSINE, "warmup_steps": 100, "min_lr": 1e-4, "eval_every": 250,
                         "eval_batches": 20, "eval_batch_size": 12, "ckpt_every": 250},
    "medium": {"n_layers": 4, "n_heads": 8, "d_model": 256, "seq_len": 128, "batch_size": 8, "steps": 400,
               "lr": 1e-3, **COSINE, "warmup_steps": 40, "min_lr": 1e-4,
               "eval_every": 100, "eval_batches": 2, "eval_batch_size": 16, "ckpt_every": 100},
    "gpt2": {"n_layers": 12, "n_heads": 12, "d_model": 768, "seq_len": 1024, "vocab_size": 50257, "head_bias": False,
             "tie_embeddings": True, "batch_size": 1, "grad_accum": 4, "steps": 100, "lr": 3e-5, "beta1": 0.9,
             "beta2": 0.99, "weight_decay": 0.0, "clip": 1.0, "lr_schedule": "constant", "eval_every": 20,
             "eval_batches": 1, "eval_batch_size": 8, "ckpt_every": 50},
    "gpt2-mini": {"n_layers": 4, "n_heads": 4, "d_model": 256, "seq_len": 256, "vocab_size": 50257, "head_bias": False,
                  "tie_embeddings": True, "batch_size": 4, "steps": 200, "lr": 3e-4, **COSINE, "warmup_steps": 20,
                  "min_lr": 3e-5, "eval_every": 50, "eval_batches": 2, "eval_batch_size": 4, "ckpt_every": 100},
    "large": {"n_layers": 6, "n_heads": 8, "d_model": 512, "seq_len": 256, "vocab_size": 512, "batch_size": 8,
              "steps": 400, "lr": 6e-4, **COSINE, "warmup_steps": 40, "min_lr": 6e-5,
              "eval_every": 100, "eval_batches": 2, "eval_batch_size": 16, "ckpt_every": 100},
}


def fit_warmup(values: dict, flags: dict, nominal_steps: int | None, origin: str) -> tuple[dict, str | None]:
    """`values` (training settings) with a warmup not given as a flag shortened to its share of a run of
    `nominal_steps` (the preset's or source run's --steps), if this run is shorter; and a note saying so."""
    warmup, steps = values.get("warmup_steps", 0), values.get("steps")
    if "warmup_steps" in flags or not warmup or not nominal_steps or steps is None or steps >= nominal_steps:
        return values, None
    if (fitted := max(1, math.ceil(warmup * steps / nominal_steps))) == warmup:
        return values, None
    return {**values, "warmup_steps": fitted}, (
        f"note: the warmup of {origin} ({warmup} of its {nominal_steps} steps) is shortened to {fitted} for "
        f"--steps {steps}, the same share of the run; pass --warmup-steps to choose another.")


def preset_values(name: str | None, flags: dict) -> tuple[dict, str | None]:
    """The values of --preset `name` (None: reference) for a run with these flags: its warmup shortened
    to its share of a shorter --steps (capstone.flags.presets.fit_warmup), and the note that says so."""
    preset = PRESETS[name or "reference"]
    values, note = fit_warmup({**preset, **flags}, flags, preset.get("steps"), f"--preset {name}")
    return {k: values[k] for k in preset}, note


def check_preset(name: str | None, explicit: dict, model: dict, train: dict, source: str) -> None:
    """ConfigError if an explicit --preset sets a value that `source`'s settings (a checkpoint's, on
    --resume) contradict, unless a flag sets it too: the checkpoint's settings win, so the preset would
    be ignored. The same command line again passes (a requeued job; another --steps too: the preset's
    warmup is compared as fitted to the run's own steps)."""
    if name is None:
        return
    saved, steps = {**model, **train}, {k: v for k, v in PRESETS[name].items() if k == "steps"}
    preset = {**preset_values(name, {**explicit, "steps": saved["steps"]})[0], **steps}
    differ = [f"{key} {saved.get(key)!r} there, {value!r} in the preset" for key, value in sorted(preset.items())
              if key not in explicit and saved.get(key) != value]
    if differ:
        more = f"; and {len(differ) - 5} more" if len(differ) > 5 else ""
        raise ConfigError(f"--preset {name} contradicts the settings of {source}: {'; '.join(differ[:5])}"
                          f"{more}. On --resume the checkpoint's settings win; drop --preset, or give the settings "
                          f"you want to change as flags (e.g. --lr 5e-4), which override the checkpoint's.")
