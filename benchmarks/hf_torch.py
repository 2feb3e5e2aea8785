"""The torch side of the Hugging Face check: `python -m capstone.export --format hf`'s directory in transformers.

    TORCH_PYTHON benchmarks/hf_torch.py HF_DIR INPUTS.safetensors

needs torch, transformers and safetensors (no capstone): loads HF_DIR with
`GPT2LMHeadModel.from_pretrained` (the loading info: missing, unexpected and mismatched keys),
computes the logits of INPUTS' `ids` in float32 (a bfloat16 model widened to it) and prints, as
JSON, those keys and the largest absolute difference from INPUTS' `logits` (capstone's, float32).
Offline: nothing is fetched.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402


def main(model_dir, inputs_path):
    transformers.logging.set_verbosity_error()
    model, info = GPT2LMHeadModel.from_pretrained(model_dir, output_loading_info=True, dtype=torch.float32)
    inputs = load_file(inputs_path)
    with torch.no_grad():
        got = model.eval()(inputs["ids"].long()).logits.double()
    want = inputs["logits"].double().reshape(got.shape)
    print(json.dumps({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                      "mismatched": [str(k) for k in info.get("mismatched_keys", [])],
                      "max_abs_diff": float((got - want).abs().max()), "logits": got.numel(),
                      "torch": torch.__version__, "transformers": transformers.__version__}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
