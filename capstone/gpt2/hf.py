"""A Hugging Face GPT-2 directory in: `--init-from DIR` and `prepare --tokenizer-from DIR`.

DIR is what `GPT2LMHeadModel.save_pretrained` writes (config.json + model.safetensors), or a hub
download of GPT-2 (the same files, its tensor names without the `transformer.` prefix), optionally
with the GPT-2 byte-level BPE beside it (vocab.json + merges.txt). It is read with `safetensors`'
NumPy API and the `tokenizers` library: no torch, no network. The config maps to capstone's
ModelConfig (n_embd, n_head, n_layer, n_positions, vocab_size, tie_word_embeddings; GPT-2 has no
head bias); what capstone's model cannot compute the same way (another activation, LayerNorm
epsilon, MLP width, attention scaling, cross-attention) is refused with the reason. A --seq-len
shorter than n_positions keeps the first rows of the position table, as nanoGPT's crop_block_size.
Imported only when such a directory is used.
"""

import contextlib
import json
import os

import numpy as np

from capstone.flags import paths
from capstone.checkpoint import CheckpointError
from capstone.config import ConfigError, ModelConfig
from capstone.gpt2.tensors import (BLOCK, DIGEST_KEY, LAYER_NORM_EPS, TOP, check_digest, gpt2_name, load,
                                   tensor_digest)
from capstone.model.params import Layout
from capstone.model.precision import values

FILES = paths.HF_FILES
TOKENIZER_FILES = ("vocab.json", "merges.txt")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")      # capstone's GELU is the tanh approximation
BUFFERS = (".attn.bias", ".attn.masked_bias")      # older files' causal-mask buffers: not parameters


def model_config(hf: dict, seq_len: int | None, path: str) -> ModelConfig:
    """capstone's ModelConfig of a GPT-2 config.json (`seq_len`: a crop of n_positions, None: all of it);
    ConfigError naming every setting capstone cannot represent."""
    C, n_positions = hf.get("n_embd"), hf.get("n_positions")
    problems = [text for wrong, text in (
        (hf.get("model_type") != "gpt2", f"model_type is {hf.get('model_type')!r}, not 'gpt2'"),
        (hf.get("activation_function", "gelu_new") not in GELU_TANH, f"activation_function "
         f"{hf.get('activation_function')!r}: capstone's MLP uses GELU's tanh approximation (gelu_new) only"),
        (abs(float(hf.get("layer_norm_epsilon", LAYER_NORM_EPS)) - LAYER_NORM_EPS) > 1e-12,
         f"layer_norm_epsilon {hf.get('layer_norm_epsilon')}: capstone's LayerNorm uses {LAYER_NORM_EPS}"),
        (hf.get("n_inner") not in (None, 4 * (C or 0)),
         f"n_inner {hf.get('n_inner')}: capstone's MLP is 4 x n_embd = {4 * (C or 0)} wide"),
        (not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"), "the attention scaling "
         "differs from 1/sqrt(head size) (scale_attn_weights false or scale_attn_by_inverse_layer_idx true)"),
        (hf.get("add_cross_attention"), "add_cross_attention: capstone's blocks have no cross-attention"),
        (seq_len is not None and isinstance(n_positions, int) and seq_len > n_positions, f"--seq-len {seq_len} is "
         f"longer than its n_positions {n_positions}: the position table has no rows beyond it; pass --seq-len "
         f"{n_positions} or less")) if wrong]
    if problems:
        raise ConfigError(f"--init-from {path}: capstone cannot represent this GPT-2 model: " + "; ".join(problems)
                          + ". Only GPT-2's own architecture is read (docs/gpt2.md).")
    try:
        return ModelConfig(vocab_size=hf["vocab_size"], seq_len=seq_len or n_positions, d_model=C,
                           n_heads=hf["n_head"], n_layers=hf["n_layer"], head_bias=False,
                           tie_embeddings=bool(hf.get("tie_word_embeddings", True)))
    except KeyError as exc:
        raise ConfigError(f"--init-from {path}: config.json lacks {exc.args[0]!r}; it is not a GPT-2 config.") from None


def capstone_name(name: str) -> str:
    """capstone's parameter name of a GPT-2 tensor name (either key set), or "" for one it has no use for."""
    name = name.removeprefix("transformer.")
    if name.endswith(BUFFERS):
        return ""
    parts = name.split(".", 2)
    inverse = {v: k for k, v in BLOCK.items()}
    if len(parts) == 3 and parts[0] == "h" and parts[1].isdigit() and parts[2] in inverse:
        return f"h{parts[1]}.{inverse[parts[2]]}"
    return {v.removeprefix("transformer."): k for k, v in TOP.items()}.get(name, name)   # unknown: `read_weights` says


def read_weights(path: str, cfg: ModelConfig, named: dict[str, np.ndarray], export: bool = False) -> np.ndarray:
    """The flat 1-rank parameters of model `cfg` from its GPT-2-named tensors `named` (wpe cropped to cfg.seq_len;
    a tied model's lm_head.weight, if stored, is skipped as wte's copy; lm_head transposed); ConfigError for extra or
    missing tensors or another shape. `export`: capstone's export file, whose names are exactly the layout's
    (`gpt2_name`; CheckpointError for what does not fit it), not any of a Hugging Face directory's."""
    layout = Layout.for_model(cfg, 1)
    flat = layout.zeros()
    views, seen, error = layout.views(flat), set(), CheckpointError if export else ConfigError
    own = {gpt2_name(n): n for n in views}
    for key, tensor in sorted(named.items()):
        name = own.get(key, key) if export else capstone_name(key)
        if not name or name == "lm_head.w" and cfg.tie_embeddings:
            continue      # a buffer, or the tied head's copy of wte (save_pretrained may keep it)
        if name not in views:
            raise error(f"--init-from {path}: tensor {key} is not part of a GPT-2 of this config.")
        got = values(tensor).astype(np.float32)     # a bfloat16 model's bits widened
        got = got.T if name == "lm_head.w" else got[:cfg.seq_len] if name == "wpe" else got
        if got.shape != views[name].shape:
            raise error(f"--init-from {path}: tensor {key} has shape {got.shape}, the config's model "
                        f"needs {views[name].shape}.")
        views[name][...] = got
        seen.add(name)
    if missing := sorted(set(views) - seen):
        raise error(f"--init-from {path}: {'the export' if export else FILES[1]} lacks {', '.join(missing[:4])}"
                    f"{' and more' if len(missing) > 4 else ''}, which " + (
                        f"its model {cfg} has. Export the checkpoint again." if export else "its config.json's model "
                        "has: the two disagree (n_layer, n_embd, ... changed in config.json?). Restore config.json "
                        "to the model's own settings, or export (or download) the model again."))
    return flat[:layout.n_params].copy()


def read_file(path: str, file: str, config, export: bool = False) -> tuple:
    """(ModelConfig, flat parameters, metadata, data identity: the tokenizer capstone's export kept in the
    metadata, else {}) of the safetensors `file` of --init-from `path` (`config(metadata)`: its model config;
    `export`: capstone's export file, as `read_weights`). CheckpointError for a file safetensors cannot read or
    whose recorded digest does not match."""
    try:
        meta, named = load(file)
        cfg = config(meta)
        check_digest(path, meta.get(DIGEST_KEY), tensor_digest(named))
        data = {"tokenizer": json.loads(meta["tokenizer"])} if "tokenizer" in meta else {}
        return cfg, read_weights(path, cfg, named, export), meta, data
    except (ConfigError, CheckpointError):
        raise
    except Exception as exc:   # noqa: BLE001 - safetensors' own SafetensorError, a bad header, bad JSON
        again = "" if export else f" (python -m capstone.export RUN_DIR --out {path} --format hf --force), or " \
                                  f"download the model again"
        raise CheckpointError(f"--init-from {path}: unreadable {'export' if export else FILES[1]} "
                              f"({type(exc).__name__}: {exc}); export the checkpoint again{again}.") from None


def read(path: str, seq_len: int | None = None):
    """(ModelConfig, flat parameters, data identity: the tokenizer of vocab.json + merges.txt if they are
    there, else the one capstone's export kept in the weights' metadata). CheckpointError for a
    model.safetensors safetensors cannot read or whose recorded digest does not match."""
    with open(os.path.join(path, FILES[0])) as f:
        try:
            hf = json.load(f)
        except ValueError as exc:
            raise ConfigError(f"--init-from {path}: config.json is not JSON ({exc}).") from None
    cfg = model_config(hf, seq_len, path)
    _, params, _, exported = read_file(path, os.path.join(path, FILES[1]), lambda meta: cfg)
    present = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
    if len(present) == 1:
        raise ConfigError(f"--init-from {path}: {present[0]} found but "
                          f"{next(n for n in TOKENIZER_FILES if n not in present)} missing: GPT-2's tokenizer is "
                          f"both files (as GPT2Tokenizer.save_pretrained writes them). Copy the missing one in, or "
                          f"remove {present[0]} to read the model as token ids only.")
    return cfg, params, {"tokenizer": gpt2_tokenizer(path).describe()} if present else exported


def exported_meta(path: str) -> dict:
    """DIR/model.safetensors' metadata (strings; capstone.export's keys, or the "pt" format key alone)."""
    from safetensors import safe_open
    with safe_open(os.path.join(path, FILES[1]), framework="numpy") as f:
        return f.metadata() or {}


def exported(path: str) -> bool:
    """Whether DIR/model.safetensors is capstone's `export --format hf` (False if it is absent or unreadable)."""
    with contextlib.suppress(Exception):   # absent, or safetensors' own SafetensorError: not an export here
        return "capstone_format" in exported_meta(path)
    return False


def gpt2_tokenizer(path: str, special: bool = True):
    """The GPT-2 byte-level BPE of DIR/vocab.json + DIR/merges.txt (capstone.data.tokenizer.from_gpt2_files;
    `special`: its special tokens matched as one id each)."""
    from capstone.data.tokenizer import TokenizerError, from_gpt2_files
    paths.refuse("--tokenizer-from", path, TokenizerError)   # a directory that may hold them
    files = [os.path.join(path, n) for n in TOKENIZER_FILES]
    if not any(os.path.isfile(f) for f in files) and exported(path):
        raise TokenizerError(f"--tokenizer-from {path}: capstone's export keeps its run's tokenizer in "
                             f"model.safetensors' metadata, not in vocab.json + merges.txt: prepare the text with "
                             f"--vocab-from <the dataset the run trained on> instead (docs/gpt2.md).")
    if not all(os.path.isfile(f) for f in files):
        raise TokenizerError(f"--tokenizer-from {path}: it needs the GPT-2 tokenizer's vocab.json and merges.txt "
                             f"(as GPT2Tokenizer.save_pretrained writes them); missing: "
                             f"{', '.join(n for n, f in zip(TOKENIZER_FILES, files) if not os.path.isfile(f))}.")
    return from_gpt2_files(*files, special=special)
