"""Held-out loss of a checkpoint in bits per character, over every token of its dataset's val.bin.

    python -m benchmarks.bpc RUN_DIR_or_CKPT --data DIR [--json]

Every val token is predicted once, in non-overlapping windows of seq_len tokens as the trainer's
held-out loss does; the first window's context comes from the end of train.bin (train then val is
the whole text), and a last, partial stretch is scored from a window that ends at the last token.
Bits per character = total nats / the held-out characters (meta.json's splits.val.chars) / ln 2, so
char and BPE datasets prepared from the same inputs are scored on the same characters.
`train_flops_per_token` is the FLOP count scripts/bench-bpe equalises between the two models.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from capstone.config import ModelConfig
from capstone.data.dataset import load_meta
from capstone.data.tokens import TokenData
from capstone.model.gpt import logits
from capstone.model.params import Layout
from capstone.sample import SampleError, load_checkpoint, resolve


def train_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token: 3 x (2 x the matmul weights, blocks and head) + attention (QK^T and AV
    over the full seq_len window, as the NumPy kernels compute it); embeddings and norms are ignored."""
    C, L, T, V = cfg.d_model, cfg.n_layers, cfg.seq_len, cfg.vocab_size
    forward = 2 * (12 * L * C * C + C * V) + 2 * 2 * L * T * C
    return 3 * forward


def windows(n_val: int, T: int) -> tuple[np.ndarray, int]:
    """Start positions in the stream (last T train tokens, then val) of the windows that predict each val
    token once, and how many targets of the last window are new (the rest were scored already)."""
    starts = list(range(T - 1, T - 1 + (n_val // T) * T, T))
    tail = n_val % T
    if tail:
        starts.append(n_val - 1)            # its targets end at the last val token
    return np.array(starts, dtype=np.int64), tail


def heldout_nats(params: np.ndarray, cfg: ModelConfig, data: TokenData, batch: int = 64) -> float:
    """Total cross-entropy (nats, float64) of every val token given up to seq_len tokens before it."""
    T, groups = cfg.seq_len, Layout.for_model(cfg, 1).groups(params)
    stream = np.concatenate([np.asarray(data.train[-T:]), np.asarray(data.val)]).astype(np.int32)
    starts, tail = windows(len(data.val), T)
    total = 0.0
    for b in range(0, len(starts), batch):
        s = starts[b:b + batch]
        idx = stream[s[:, None] + np.arange(T + 1)]                      # (n, T+1)
        z = logits(groups, idx[:, :-1], cfg).astype(np.float64)          # (n*T, V)
        top = z.max(axis=1, keepdims=True)
        nats = (np.log(np.exp(z - top).sum(axis=1)) + top[:, 0] - z[np.arange(z.shape[0]), idx[:, 1:].reshape(-1)])
        nats = nats.reshape(len(s), T)
        if tail and b + batch >= len(starts):
            nats[-1, :T - tail] = 0.0                                    # scored by the window before
        total += float(nats.sum())
    return total


def evaluate(target: str, data_dir: str) -> dict:
    path = resolve(target)
    meta, cfg, params = load_checkpoint(path)
    data = TokenData(data_dir, cfg.seq_len, 1, 0).verify()
    if data.identity()["digest"] != (meta.get("data") or {}).get("digest", data.identity()["digest"]):
        raise SampleError(2, f"{data_dir} is not the dataset {path} was trained on")
    nats, chars = heldout_nats(params, cfg, data), load_meta(data_dir).val.chars
    return {"checkpoint": path, "step": meta["step"], "tokens": len(data.val), "chars": chars, "nats": nats,
            "nats_per_token": nats / len(data.val), "bits_per_char": nats / chars / math.log(2),
            "train_flops_per_token": train_flops_per_token(cfg), "global_batch": meta["global_batch"],
            "model_config": meta["model_config"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bpc", description=__doc__.splitlines()[0])
    p.add_argument("target", metavar="RUN_DIR_or_CKPT")
    p.add_argument("--data", required=True, metavar="DIR", help="the prepared dataset the run was trained on")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        r = evaluate(args.target, args.data)
    except SampleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    print(json.dumps(r) if args.json else f"{r['checkpoint']}: {r['bits_per_char']:.4f} bits/char "
          f"({r['nats_per_token']:.4f} nats/token over {r['tokens']} tokens, {r['chars']} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
