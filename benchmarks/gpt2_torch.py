"""A plain-PyTorch GPT-2 that loads `python -m capstone.export`'s file, and the torch side of the check.

    TORCH_PYTHON benchmarks/gpt2_torch.py MODEL.safetensors INPUTS.safetensors

needs only torch and safetensors (no capstone): it loads the model, computes the logits of INPUTS'
`ids` in float32 and in float64 and prints, as JSON, the largest absolute difference of each from
INPUTS' `logits` (capstone's, float32) and from each other (float32's own rounding).
docs/export.md shows the module part of this file (tests/test_export.py keeps the two the same).
"""

import json
import math
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight (in, out), y = x @ weight + bias."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, Conv1D(c, 3 * c), Conv1D(c, c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))   # causal
        y = att.softmax(dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(c, 4 * c), Conv1D(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's "gelu_new"


class Block(nn.Module):
    def __init__(self, c, heads, eps):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c, eps=eps), Attention(c, heads)
        self.ln_2, self.mlp = nn.LayerNorm(c, eps=eps), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (pre-LN blocks, learned positions) with capstone's untied head, with a bias unless trained without."""

    def __init__(self, cfg):
        super().__init__()
        C, eps = cfg["n_embd"], cfg["layer_norm_epsilon"]
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg["vocab_size"], C), wpe=nn.Embedding(cfg["n_positions"], C),
            h=nn.ModuleList(Block(C, cfg["n_head"], eps) for _ in range(cfg["n_layer"])),
            ln_f=nn.LayerNorm(C, eps=eps)))
        self.lm_head = nn.Linear(C, cfg["vocab_size"], bias=cfg["lm_head_bias"])   # weight (vocab, C)

    def forward(self, idx):                                                  # idx (B, T), T <= n_positions
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))                         # logits (B, T, vocab)


def load(path):
    with safe_open(path, framework="pt") as f:
        cfg = json.loads(f.metadata()["gpt2_config"])
    model = GPT(cfg)
    model.load_state_dict(load_file(path))      # strict: every name and shape must match
    return model.eval()


def main(model_path, inputs_path):
    inputs = load_file(inputs_path)
    ids, model = inputs["ids"].long(), load(model_path)
    with torch.no_grad():
        f32 = model(ids).double()
        f64 = model.double()(ids)
    want = inputs["logits"].double().reshape(f32.shape)
    print(json.dumps({"max_abs_diff": float((f32 - want).abs().max()), "float64_vs_capstone": float((f64 - want).abs().max()),
                      "float32_vs_float64": float((f32 - f64).abs().max()), "logits": f32.numel(),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
