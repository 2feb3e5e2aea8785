"""capstone's logits against the exported file's in plain PyTorch (benchmarks/gpt2_torch.py).

    python -m benchmarks.export_vs_torch RUN_DIR_or_CKPT --torch TORCH_PYTHON [--sequences 8] [--format hf]

Exports the checkpoint with `capstone.export`, computes capstone's logits (capstone.model.gpt.logits)
for random full-length sequences, hands the ids and logits to TORCH_PYTHON as a safetensors file
(never pickle) and prints the largest absolute difference of the torch module's float32 logits, with
the float32 rounding floor beside it (the same module in float64 against capstone and against its own
float32). Exit 1 when the difference exceeds 1e-5 times max(1, the largest |logit|): float32 carries
about 7 digits, so a trained model's logits of magnitude ~10 differ by ~1e-5 between any two float32
implementations (docs/export.md). With `--format hf` the export is the Hugging Face directory and the
torch side transformers' GPT2LMHeadModel (benchmarks/hf_torch.py; a model trained without a head bias).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import save_file

from capstone.export import export
from capstone.model.gpt import logits
from capstone.model.params import Layout
from capstone.sample import load_checkpoint, resolve
from capstone.gpt2.vocab import SampleError

TOLERANCE = 1e-5
HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.export_vs_torch", description=__doc__.splitlines()[0])
    p.add_argument("target", metavar="RUN_DIR_or_CKPT")
    p.add_argument("--torch", required=True, metavar="PYTHON", help="a Python with torch and safetensors")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="hf: the directory in transformers' GPT2LMHeadModel (benchmarks/hf_torch.py)")
    args = p.parse_args(argv)
    path = resolve(args.target)
    meta, cfg, params = load_checkpoint(path)
    ids = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.sequences, cfg.seq_len), dtype=np.int32)
    want = logits(Layout.for_model(cfg, 1).groups(params), ids, cfg).reshape(args.sequences, cfg.seq_len, -1)
    with tempfile.TemporaryDirectory() as tmp:
        hf = args.format == "hf"
        model = os.path.join(tmp, "model" if hf else "model.safetensors")
        inputs = os.path.join(tmp, "inputs.safetensors")
        try:
            export(path, model, args.format)
        except SampleError as exc:
            sys.exit(f"error: {exc}")
        save_file({"ids": ids.astype(np.int64), "logits": np.ascontiguousarray(want, np.float32)}, inputs)
        run = subprocess.run([args.torch, os.path.join(HERE, "hf_torch.py" if hf else "gpt2_torch.py"), model, inputs],
                             capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"the torch side failed (exit {run.returncode}):\n{run.stderr}")
    r = json.loads(run.stdout)
    if args.format == "hf":
        print(f"GPT2LMHeadModel.from_pretrained: missing {r['missing']}, unexpected {r['unexpected']}, "
              f"transformers {r['transformers']}")
        r = {"float64_vs_capstone": float("nan"), "float32_vs_float64": float("nan"), **r}
    scale = max(1.0, float(np.abs(want).max()))
    ok = r["max_abs_diff"] <= TOLERANCE * scale
    print(f"{path} (step {meta['step']}; vocab {cfg.vocab_size}, seq_len {cfg.seq_len}, d_model {cfg.d_model}, "
          f"{cfg.n_layers} layers), {r['logits']} logits ({args.sequences} x {cfg.seq_len} x {cfg.vocab_size}), "
          f"|logit| <= {float(np.abs(want).max()):.2f}, torch {r['torch']}:\n"
          f"  max |torch float32 - capstone|  {r['max_abs_diff']:.3g}   "
          f"({'within' if ok else 'ABOVE'} 1e-5 x max(1, |logit|) = {TOLERANCE * scale:.3g})\n"
          f"  float32 rounding floor: max |torch float64 - capstone| {r['float64_vs_capstone']:.3g}, "
          f"max |torch float64 - torch float32| {r['float32_vs_float64']:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
