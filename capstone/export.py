"""`python -m capstone.export RUN_DIR|CKPT --out model.safetensors`: the weights under GPT-2's names.

The checkpoint is read and verified as `capstone.sample` does; its float32 parameters are written
with `safetensors` (never pickle) under Hugging Face GPT-2 names: `transformer.wte.weight`,
`transformer.h.{i}.attn.c_attn.weight`, ... Block weights stay (in, out) like GPT-2's Conv1D; the
untied head is two extra tensors, `lm_head.weight` (vocab, d_model) as nn.Linear stores it and
`lm_head.bias` (a tied head, --tie-embeddings, is wte: no lm_head.weight, `tie_word_embeddings` true). The metadata holds the GPT-2 config, capstone's model config, the step and the
tokenizer (docs/export.md). `--format hf` writes a directory that transformers'
`GPT2LMHeadModel.from_pretrained` loads (config.json + model.safetensors, as `save_pretrained` writes
them), for a model without an LM-head bias: GPT-2 has none, so a model with one is refused; a model
without the other biases (--no-bias) gets zeros for them. An existing --out is replaced only with --force; files get the
umask's mode. Exit codes: 0 ok; 1 not a valid checkpoint; 2 bad arguments.
"""

import argparse
import json
import os
import sys

import numpy as np

from capstone.flags import paths
from capstone.checkpoint.files import write_atomic
from capstone.config import ModelConfig
from capstone.model.params import Layout
from capstone.model.precision import narrow
from capstone.flags.pipe import fail, run_tool
from capstone.gpt2 import tensors
from capstone.gpt2.vocab import SampleError

HF_FILES = paths.HF_FILES
MODEL_DIRECTORIES = (paths.Kind.HF_MODEL, paths.Kind.HF_HALF, paths.Kind.HF_PICKLE)   # --format hf --force replaces
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")   # torch.save's and pickle's names


def check_out(out: str, fmt: str, force: bool) -> None:
    """SampleError(2) for an --out this export must not write: a pickle's name, a file where a directory
    goes or the reverse, a file's missing parent, or an existing export without --force."""
    suffix = os.path.splitext(out.rstrip("/"))[1].lower()
    if suffix in PICKLE_SUFFIXES:
        raise SampleError(2, f"--out {out}: a {suffix} name means a pickle (torch.save) to PyTorch and transformers, "
                             f"but this writes safetensors. Name it "
                             f"{out[:-len(suffix)] + ('.safetensors' if fmt == 'safetensors' else '')}.")
    folder = os.path.dirname(os.path.abspath(out))
    if fmt == "safetensors" and not os.path.isdir(folder):   # --format hf makes its directory, parents too
        raise SampleError(2, f"--out {out}: the directory {folder} does not exist; create it first.")
    # a directory for a file, or the reverse
    found = paths.refuse(f"export --out{' --format hf' if fmt == 'hf' else ''}", out, lambda said: SampleError(2, said))
    if fmt == "hf" and suffix == ".safetensors" and found is paths.Kind.MISSING:
        raise SampleError(2, f"--out {out} names a file, but --format hf writes a directory (config.json, "
                             f"model.safetensors); pass a directory name such as {out[:-len(suffix)]}, or drop "
                             f"--format hf to write the one file.")
    if (found is not paths.Kind.MISSING if fmt == "safetensors" else found in MODEL_DIRECTORIES) and not force:
        raise SampleError(2, f"--out {out} already exists{' and holds a model' if fmt == 'hf' else ''}; it is not "
                             f"replaced without --force. Pass another --out, or --force to replace it.")


def write_bytes(data: bytes, out: str) -> None:
    """`data` to `out` through a temp file renamed over it: a crash leaves the old file or the new one,
    never half of one; the mode is the umask's, as for any file the user makes. Its directory is made if missing
    (--format hf's; check_out has refused a missing one for a file)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_atomic(out, data)
    except OSError as exc:
        raise SampleError(2, f"cannot write {out} ({exc}); check the path, its permissions and free space.") from None


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict:
    """config.json of GPT2LMHeadModel, as `save_pretrained` writes it (no dropout; no GPT-2 special tokens,
    which lie outside this vocabulary)."""
    gpt2 = {k: v for k, v in tensors.gpt2_config(cfg).items() if k != "lm_head_bias"}   # the fields GPT-2 has
    return {**gpt2, "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.0, "bos_token_id": None, "dtype": dtype,
            "embd_pdrop": 0.0, "eos_token_id": None, "initializer_range": 0.02, "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.0, "scale_attn_by_inverse_layer_idx": False, "use_cache": True}


def write_hf(views: dict[str, np.ndarray], cfg: ModelConfig, md: dict, out: str, save) -> dict[str, np.ndarray]:
    """The Hugging Face directory of a model with the layout entries `views`: config.json and
    model.safetensors (metadata format "pt", as transformers requires; capstone's own keys beside it).
    SampleError(2) for a model whose layout has a head bias, which GPT2LMHeadModel would drop."""
    if "lm_head.b" in views:
        raise SampleError(2, "--format hf: this model has an LM-head bias (lm_head.b), and GPT-2 has none: "
                             "GPT2LMHeadModel.from_pretrained would drop it and its logits would differ by it. Export "
                             "a model trained with --no-head-bias, or drop --format hf: the default safetensors file "
                             "keeps the bias (docs/export.md shows a PyTorch module that loads it).")
    bits = next(iter(views.values())).dtype              # float32, or bfloat16's (uint16): zero is 0 in both
    named = tensors.named_tensors({**views, **{k: z.astype(bits) for k, z in tensors.absent_biases(cfg).items()}})
    md = {"capstone_format": md.pop("format"), **md, tensors.DIGEST_KEY: tensors.tensor_digest(named), "format": "pt"}
    write_bytes(save(named, metadata=md), os.path.join(out, HF_FILES[1]))
    dtype = "bfloat16" if bits == np.uint16 else "float32"
    write_bytes((json.dumps(hf_config(cfg, dtype), indent=2, sort_keys=True) + "\n").encode(), os.path.join(out, HF_FILES[0]))
    return named


def write_tokenizer(tokenizer: str | None, cfg: ModelConfig, out: str) -> list[str]:
    """The run's tokenizer as GPT-2's files in the hf directory `out` (vocab.json, merges.txt and, with
    the special token in its vocabulary, tokenizer_config.json and special_tokens_map.json), so that
    transformers' AutoTokenizer loads it: a byte-level BPE is GPT-2's kind. A character vocabulary has no
    GPT-2 form: none is written (it stays in model.safetensors' metadata). Returns the names written."""
    desc = json.loads(tokenizer) if tokenizer else {}
    if desc.get("kind") != "bpe":
        return []
    from capstone.data.tokenizer import GPT2_SPECIAL, from_description, library
    tok = library().Tokenizer.from_str(from_description(desc).json)
    names = tok.model.save(out)          # vocab.json, merges.txt
    special = {"bos_token": GPT2_SPECIAL, "eos_token": GPT2_SPECIAL, "unk_token": GPT2_SPECIAL} \
        if GPT2_SPECIAL in tok.get_vocab() else {}
    for name, spec in (("tokenizer_config.json", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
                                                  "model_max_length": cfg.seq_len, **special}),
                       ("special_tokens_map.json", special)):
        write_bytes((json.dumps(spec, indent=2, sort_keys=True) + "\n").encode(), os.path.join(out, name))
    return sorted(os.path.basename(n) for n in names) + ["special_tokens_map.json", "tokenizer_config.json"]


def _load(target: str):
    from capstone.sample import load_checkpoint, resolve
    path = resolve(target, "export")   # SampleError 2: no checkpoint there; 1: an invalid one
    meta, cfg, params = load_checkpoint(path)
    return path, meta, cfg, Layout.for_model(cfg, 1).views(params)


def export(target: str, out: str, fmt: str = "safetensors", force: bool = False, dtype: str = "float32") -> dict:
    """Write the checkpoint `target` (a run directory or ckpt file) to `out` (a file, or for fmt "hf" a
    directory), its tensors float32 or (`dtype` "bfloat16") rounded to bfloat16; returns a summary."""
    check_out(out, fmt, force)
    tensors.library()
    path, meta, cfg, views = _load(target)
    if dtype == "bfloat16":   # the float32 master rounded to nearest even, as a bf16 run's working weights
        views = {name: narrow(a) for name, a in views.items()}
    if fmt == "hf":
        md = tensors.metadata(meta, cfg, path, head_bias=False)
        named = write_hf(views, cfg, dict(md), out, tensors.save)
        tokenizer = write_tokenizer(md.get("tokenizer"), cfg, out)
        size = sum(os.path.getsize(os.path.join(out, n)) for n in HF_FILES + tuple(tokenizer))
    else:
        named = tensors.named_tensors(views)
        md = {**tensors.metadata(meta, cfg, path, "lm_head.b" in views), tensors.DIGEST_KEY: tensors.tensor_digest(named)}
        write_bytes(tensors.save(named, metadata=md), out)
        size = os.path.getsize(out)
    return {"checkpoint": path, "step": meta["step"], "tensors": len(named),
            "parameters": int(sum(a.size for a in named.values())), "bytes": size,
            "judged": meta.get("judged", True) is not False, "format": fmt,
            "tokenizer": tokenizer if fmt == "hf" else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m capstone.export", description=__doc__.splitlines()[0].split(": ", 1)[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("target", metavar="RUN_DIR_or_CKPT", help="a training run directory (its latest checkpoint) or a "
                                                              "ckpt-*.h5 file")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="the .safetensors file to write, or with --format hf the directory")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file, GPT-2 names, capstone's head bias included (docs/export.md); hf: a "
                        "directory GPT2LMHeadModel.from_pretrained loads (a model trained without a head bias)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the tensors' type: float32 (the checkpoint's master weights as they are) or bfloat16 (rounded "
                        "to nearest even: half the bytes; --init-from and transformers read both)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    try:
        s = export(args.target, args.out, args.format, args.force, args.dtype)
    except SampleError as exc:
        return fail(exc, exc.code)
    print(f"wrote {args.out}: {s['tensors']} tensors, {s['parameters']} parameters, {s['bytes']} bytes, from "
          f"{s['checkpoint']} (step {s['step']})")
    if s["tokenizer"]:
        print(f"tokenizer: {', '.join(s['tokenizer'])} (GPT-2's byte-level BPE files: AutoTokenizer loads them)")
    elif s["format"] == "hf":
        print("note: no tokenizer files: the run's vocabulary is characters (or the synthetic corpus's ids), which "
              "have no GPT-2 tokenizer form; `python -m capstone.sample` decodes with it (docs/export.md)")
    if not s["judged"]:
        print(f"note: {s['checkpoint']} was saved by a stop before the divergence guard judged it; the export says so, "
              f"and --init-from refuses it (resume that run once to judge the state, then export a later checkpoint)")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
