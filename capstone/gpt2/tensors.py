"""GPT-2's tensors as capstone writes and reads them: the Hugging Face names of the layout's
entries, the tensors' sha256 digest, the safetensors metadata and GPT-2's config fields.

capstone.export writes them; capstone.gpt2.finetune and capstone.gpt2.hf read them back.
"""

import dataclasses
import hashlib
import json
import os

import numpy as np

from capstone.checkpoint import CheckpointError
from capstone.config import ModelConfig
from capstone.gpt2.vocab import SampleError
from capstone.model.params import param_shapes

SAFETENSORS_PIN = "safetensors==0.8.0"
FORMAT = "capstone-gpt2"
DIGEST_KEY = "tensor_sha256"     # metadata: sha256 of the tensors (`tensor_digest`), verified by --init-from
NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
         "U8": "u1", "BOOL": "?"}    # safetensors' dtypes as NumPy reads them (BF16: its bits)
LAYER_NORM_EPS = 1e-5            # capstone.model.kernels._ln_fwd
BLOCK = {f"{module}.{short}": f"{module}.{full}"   # a block's parameters: ln_1.w -> ln_1.weight, ...
         for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
         for short, full in (("w", "weight"), ("b", "bias"))}
TOP = {"wte": "transformer.wte.weight", "wpe": "transformer.wpe.weight", "ln_f.w": "transformer.ln_f.weight",
       "ln_f.b": "transformer.ln_f.bias", "lm_head.w": "lm_head.weight", "lm_head.b": "lm_head.bias"}


def gpt2_name(name: str) -> str:
    """The GPT-2 name of a capstone parameter (`h3.attn.c_attn.w` -> `transformer.h.3.attn.c_attn.weight`)."""
    if name in TOP:
        return TOP[name]
    layer, _, rest = name.partition(".")
    return f"transformer.h.{int(layer[1:])}.{BLOCK[rest]}"


def named_tensors(views: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-2 name -> contiguous array (float32, or bfloat16's bits), for the layout's entries (`Layout.views`);
    lm_head.weight transposed to (vocab, d_model)."""
    return {gpt2_name(n): np.ascontiguousarray(a.T if n == "lm_head.w" else a) for n, a in views.items()}


def save(named: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """The safetensors file of `named`: float32 arrays as F32, uint16 ones as BF16 (bfloat16's bits: an export's
    --dtype bfloat16, capstone.model.precision)."""
    from safetensors import TensorSpec, serialize
    kind = {"float32": "float32", "uint16": "bfloat16"}
    return bytes(serialize({k: TensorSpec(dtype=kind[a.dtype.name], shape=a.shape, data_ptr=a.ctypes.data,
                                          data_len=a.nbytes) for k, a in named.items()}, metadata=metadata))


def load(path: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """(metadata, name -> array) of a safetensors file, a BF16 tensor as its bits (uint16: precision.values widens
    it; NumPy has no bfloat16); exceptions of safetensors' own for a damaged file."""
    from safetensors import deserialize, safe_open
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
    with open(path, "rb") as f:
        flat = deserialize(f.read())
    return meta, {name: np.frombuffer(t["data"], dtype=NUMPY[t["dtype"]]).reshape(t["shape"]) for name, t in flat}


def tensor_digest(tensors: dict[str, np.ndarray]) -> str:
    """sha256 hex of the tensors in name order: what an export records under DIGEST_KEY. Each tensor feeds it its
    name, dtype and shape (a text line), then its little-endian bytes in C order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.dtype(tensors[name].dtype).newbyteorder("<"))
        h.update(f"{name} {a.dtype.str} {list(a.shape)}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def check_digest(target: str, want: str | None, got: str) -> None:
    """CheckpointError (exit 1) if an export's recorded digest `want` (None: none recorded) is not `got`."""
    if want is not None and want != got:
        raise CheckpointError(f"--init-from {target}: its tensor data does not match the sha256 its export recorded "
                              f"({DIGEST_KEY} {want[:12]}..., the data's {got[:12]}...): the file was damaged or "
                              f"altered after it was written. Export the checkpoint again (python -m capstone.export "
                              f"RUN_DIR --out ...) and pass the new export.")


def absent_biases(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Zeros for the biases a --no-bias model does not have (GPT-2 has them; zero is the same function)."""
    whole = dict(param_shapes(dataclasses.replace(cfg, bias=True)))
    return {name: np.zeros(whole[name], np.float32) for name, shape in param_shapes(cfg, absent=True) if shape is None}


def gpt2_config(cfg: ModelConfig, head_bias: bool = True) -> dict:
    """The Hugging Face GPT2Config fields this model has, plus what GPT-2 lacks (an untied head, its bias if any)."""
    return {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len,
            "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": 4 * cfg.d_model,
            "layer_norm_epsilon": LAYER_NORM_EPS, "activation_function": "gelu_new",
            "tie_word_embeddings": cfg.tie_embeddings, "lm_head_bias": head_bias, "scale_attn_weights": True}


def metadata(meta: dict, cfg: ModelConfig, path: str, head_bias: bool = True) -> dict[str, str]:
    """safetensors metadata (strings only): format, configs, provenance and the tokenizer, as JSON text."""
    tokenizer = (meta.get("data") or {}).get("tokenizer")
    out = {"format": FORMAT, "format_version": "1",
           "gpt2_config": json.dumps(gpt2_config(cfg, head_bias), sort_keys=True),
           "capstone_model_config": json.dumps(dataclasses.asdict(cfg), sort_keys=True), "step": str(meta["step"]),
           "checkpoint": os.path.basename(path), "weights": "Conv1D (in, out); lm_head.weight (out, in)"}
    if tokenizer is not None:
        out["tokenizer"] = json.dumps(tokenizer, sort_keys=True)
    if meta.get("judged", True) is False:   # a stop's checkpoint the guard never judged: --init-from refuses it
        out["judged"] = "false"
    return out


def library(error=lambda said: SampleError(2, said)):
    """safetensors' NumPy API, or `error` (of the message: SampleError 2 by default) saying how to install it."""
    try:
        from safetensors import numpy as st
    except ImportError:
        raise error(f"export needs the `safetensors` library: pip install {SAFETENSORS_PIN} "
                    f"(scripts/setup installs it).") from None
    return st
