"""The transformers side of tests/test_gpt2_hf.py (run by the torch venv's Python; not a test module).

    TORCH_PYTHON tests/gpt2_make.py OUT_DIR CONFIG_JSON TEXT

makes a GPT2LMHeadModel of GPT2Config(**CONFIG_JSON) with seed 0 and `save_pretrained(OUT_DIR)`
(config.json + model.safetensors); if OUT_DIR holds vocab.json + merges.txt, prints as JSON the ids
transformers' GPT2Tokenizer gives TEXT. Offline: nothing is fetched.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer  # noqa: E402


def main(out, config, text):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**json.loads(config)))
    with torch.no_grad():       # non-trivial LayerNorms and biases, so that every tensor is read
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    ids = None
    if os.path.exists(os.path.join(out, "vocab.json")):
        tok = GPT2Tokenizer(os.path.join(out, "vocab.json"), os.path.join(out, "merges.txt"))
        ids = tok(text)["input_ids"]
    print(json.dumps({"ids": ids, "files": sorted(os.listdir(out)), "tied": model.lm_head.weight is
                      model.transformer.wte.weight}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
