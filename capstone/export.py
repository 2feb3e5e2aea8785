"""`python -m capstone.export RUN_DIR|CKPT --out model.safetensors`: the weights under GPT-2's names.

The checkpoint is read and verified as `capstone.sample` does; its float32 parameters are written
with `safetensors` (never pickle) under Hugging Face GPT-2 names: `transformer.wte.weight`,
`transformer.h.{i}.attn.c_attn.weight`, ... Block weights stay (in, out) like GPT-2's Conv1D; the
untied head is two extra tensors, `lm_head.weight` (vocab, d_model) as nn.Linear stores it and
`lm_head.bias`. The metadata holds the GPT-2 config, capstone's model config, the step and the
tokenizer (docs/export.md). Exit codes: 0 ok; 1 not a valid checkpoint; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from capstone.checkpoint import CheckpointError, serial
from capstone.config import ConfigError, ModelConfig
from capstone.model.params import Layout
from capstone.vocab import SampleError

SAFETENSORS_PIN = "safetensors==0.8.0"
FORMAT = "capstone-gpt2"
LAYER_NORM_EPS = 1e-5            # capstone.model.kernels._ln_fwd
BLOCK = {"ln_1.w": "ln_1.weight", "ln_1.b": "ln_1.bias", "attn.c_attn.w": "attn.c_attn.weight",
         "attn.c_attn.b": "attn.c_attn.bias", "attn.c_proj.w": "attn.c_proj.weight", "attn.c_proj.b": "attn.c_proj.bias",
         "ln_2.w": "ln_2.weight", "ln_2.b": "ln_2.bias", "mlp.c_fc.w": "mlp.c_fc.weight", "mlp.c_fc.b": "mlp.c_fc.bias",
         "mlp.c_proj.w": "mlp.c_proj.weight", "mlp.c_proj.b": "mlp.c_proj.bias"}
TOP = {"wte": "transformer.wte.weight", "wpe": "transformer.wpe.weight", "ln_f.w": "transformer.ln_f.weight",
       "ln_f.b": "transformer.ln_f.bias", "lm_head.b": "lm_head.bias"}


def gpt2_name(name: str) -> str:
    """The GPT-2 name of a capstone parameter (`h3.attn.c_attn.w` -> `transformer.h.3.attn.c_attn.weight`)."""
    if name in TOP:
        return TOP[name]
    if name == "lm_head.w":
        return "lm_head.weight"
    layer, _, rest = name.partition(".")
    return f"transformer.h.{int(layer[1:])}.{BLOCK[rest]}"


def gpt2_tensors(params: np.ndarray, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """GPT-2 name -> contiguous float32 array; lm_head.weight transposed to (vocab, d_model)."""
    views = Layout.for_model(cfg, 1).views(params)
    return {gpt2_name(n): np.ascontiguousarray(a.T if n == "lm_head.w" else a, dtype=np.float32)
            for n, a in views.items()}


def gpt2_config(cfg: ModelConfig) -> dict:
    """The Hugging Face GPT2Config fields this model has, plus what GPT-2 lacks (an untied head with a bias)."""
    return {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len,
            "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": 4 * cfg.d_model,
            "layer_norm_epsilon": LAYER_NORM_EPS, "activation_function": "gelu_new", "tie_word_embeddings": False,
            "lm_head_bias": True, "scale_attn_weights": True}


def metadata(meta: dict, cfg: ModelConfig, path: str) -> dict[str, str]:
    """safetensors metadata (strings only): format, configs, provenance and the tokenizer, as JSON text."""
    tokenizer = (meta.get("data") or {}).get("tokenizer")
    out = {"format": FORMAT, "format_version": "1", "gpt2_config": json.dumps(gpt2_config(cfg), sort_keys=True),
           "capstone_model_config": json.dumps(dataclasses.asdict(cfg), sort_keys=True), "step": str(meta["step"]),
           "checkpoint": os.path.basename(path), "weights": "Conv1D (in, out); lm_head.weight (out, in)"}
    if tokenizer is not None:
        out["tokenizer"] = json.dumps(tokenizer, sort_keys=True)
    return out


def _save_file():
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise SampleError(2, f"export needs the `safetensors` library: pip install {SAFETENSORS_PIN} "
                             f"(scripts/setup installs it).") from None
    return save_file


def export(target: str, out: str) -> dict:
    """Write the checkpoint `target` (a run directory or ckpt file) to `out`; returns a summary."""
    if os.path.isdir(out):
        raise SampleError(2, f"--out {out} is a directory; pass a file name such as {out.rstrip('/')}/model.safetensors.")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise SampleError(2, f"--out {out}: the directory {folder} does not exist; create it first.")
    save_file = _save_file()
    try:
        path = serial.find(target)
        meta, cfg, params = serial.load_weights(path)
    except (ConfigError, CheckpointError) as exc:   # 2: no checkpoint there; 1: an invalid one
        raise SampleError(1 if isinstance(exc, CheckpointError) else 2, str(exc)) from None
    tensors = gpt2_tensors(params, cfg)
    tmp = os.path.join(folder, f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        save_file(tensors, tmp, metadata=metadata(meta, cfg, path))
        os.replace(tmp, out)
    except OSError as exc:
        raise SampleError(2, f"cannot write {out} ({exc}); check the path, its permissions and free space.") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"checkpoint": path, "step": meta["step"], "tensors": len(tensors),
            "parameters": int(sum(a.size for a in tensors.values())), "bytes": os.path.getsize(out)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m capstone.export", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("target", metavar="RUN_DIR_or_CKPT", help="a training run directory (its latest checkpoint) or a "
                                                              "ckpt-*.h5 file")
    p.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file to write (replaced if it exists)")
    args = p.parse_args(argv)
    try:
        s = export(args.target, args.out)
    except SampleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    print(f"wrote {args.out}: {s['tensors']} tensors, {s['parameters']} parameters, {s['bytes']} bytes, from "
          f"{s['checkpoint']} (step {s['step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
