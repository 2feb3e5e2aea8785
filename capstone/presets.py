"""Named settings (`--preset NAME`): plain data, overridden by any flag given explicitly.

`reference` is the product's experiment (every default). `shakespeare-char` is nanoGPT's CPU
"baby GPT" on character-level Shakespeare; `medium` and `large` are sizes where speed matters
(docs/performance.md measures them).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "reference": {},
    "shakespeare-char": {
        "n_layers": 4, "n_heads": 4, "d_model": 128, "seq_len": 64,
        "data": "data/shakespeare", "global_batch": 12, "steps": 2000,
        "lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "clip": 1.0,
        "lr_schedule": "cosine", "warmup_steps": 100, "min_lr": 1e-4,
        "eval_every": 250, "eval_batches": 20, "eval_batch_size": 12, "ckpt_every": 250,
    },
    "medium": {
        "n_layers": 4, "n_heads": 8, "d_model": 256, "seq_len": 128, "batch_size": 8, "steps": 400,
        "lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "clip": 1.0,
        "lr_schedule": "cosine", "warmup_steps": 40, "min_lr": 1e-4,
        "eval_every": 100, "eval_batches": 2, "eval_batch_size": 16, "ckpt_every": 100,
    },
    "large": {
        "n_layers": 6, "n_heads": 8, "d_model": 512, "seq_len": 256, "vocab_size": 512, "batch_size": 8,
        "steps": 400, "lr": 6e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1, "clip": 1.0,
        "lr_schedule": "cosine", "warmup_steps": 40, "min_lr": 6e-5,
        "eval_every": 100, "eval_batches": 2, "eval_batch_size": 16, "ckpt_every": 100,
    },
}
