"""Autoregressive decoding of MiniGPT on one process: a KV cache, the next-token rule, the loop.

`KVCache` runs the model on the new positions only, attending over cached keys and values (the
same kernels and arithmetic as `capstone.model.gpt.logits`). `pick` turns next-token logits into
an id: ids at or beyond `limit` (the tokenizer's vocabulary, when the model's is larger) are never
drawn; temperature 0 is greedy; then top-k, then top-p (nucleus), then one uniform draw through the
float32 CDF, as nanoGPT. `generate` crops the context to the last seq_len tokens, as nanoGPT does.
"""

import math

import numpy as np

from capstone.config import ModelConfig
from capstone.model.gpt import logits as full_logits
from capstone.model.ops import layer_norm, linear, linear_gelu
from capstone.model.params import Layout


class KVCache:
    """Incremental forward of MiniGPT (batch 1): keys and values of earlier positions are kept per layer,
    so each new position costs one row of every matmul. Same math as `capstone.model.gpt.logits`."""

    def __init__(self, p: dict, cfg: ModelConfig):
        self.p, self.cfg = p, cfg
        self.H, self.D = cfg.n_heads, cfg.d_model // cfg.n_heads
        shape = (cfg.n_layers, self.H, cfg.seq_len, self.D)
        self.k, self.v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.n = 0                                  # positions cached

    def reset(self) -> None:
        self.n = 0

    def _attend(self, i: int, qkv: np.ndarray, last: bool) -> np.ndarray:
        """Causal attention of the new rows qkv (n, 3C) over cached + new positions of layer i -> (n, C)
        (only the last row's output, (1, C), if `last`: every new row's key and value is cached anyway)."""
        n, s, H, D = qkv.shape[0], self.n, self.H, self.D
        q, k, v = qkv.reshape(n, 3, H, D).transpose(1, 2, 0, 3)             # each (H, n, D)
        self.k[i, :, s:s + n], self.v[i, :, s:s + n] = k, v
        q = q[:, -1:] if last else q
        att = q @ self.k[i, :, :s + n].swapaxes(-1, -2)                      # (H, rows, s+n)
        att *= 1.0 / math.sqrt(D)
        if q.shape[1] > 1:
            att += np.triu(np.full((n, s + n), -np.inf, dtype=np.float32), k=s + 1)
        att -= att.max(axis=-1, keepdims=True)
        np.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)
        return (att @ self.v[i, :, :s + n]).transpose(1, 0, 2).reshape(q.shape[1], H * D)

    def forward(self, ids, last: bool = False) -> np.ndarray:
        """Logits (n, V) of the tokens `ids` at the next n positions (only the last position's, (1, V), if
        `last`: the top block then skips the other rows after attention); their keys/values join the cache."""
        p, n, s, L = self.p, len(ids), self.n, self.cfg.n_layers
        if s + n > self.cfg.seq_len:
            raise ValueError(f"{s}+{n} positions exceed seq_len {self.cfg.seq_len}; reset() and crop the context")
        x = p["wte"][np.asarray(ids)] + p["wpe"][s:s + n]                    # (n, C)
        for i in range(L):
            h, top = f"h{i}.", last and i == L - 1
            a = layer_norm(x, p[h + "ln_1.w"], p.get(h + "ln_1.b"))
            y = self._attend(i, linear(a, p[h + "attn.c_attn.w"], p.get(h + "attn.c_attn.b")), top)
            x = (x[-1:] if top else x) + linear(y, p[h + "attn.c_proj.w"], p.get(h + "attn.c_proj.b"))
            u = linear_gelu(layer_norm(x, p[h + "ln_2.w"], p.get(h + "ln_2.b")), p[h + "mlp.c_fc.w"], p.get(h + "mlp.c_fc.b"))
            x = x + linear(u, p[h + "mlp.c_proj.w"], p.get(h + "mlp.c_proj.b"))
        self.n = s + n
        z = layer_norm(x, p["ln_f.w"], p.get("ln_f.b"))
        w = p["lm_head.w"] if "lm_head.w" in p else p["wte"].T                # --tie-embeddings: the head is wte
        return linear(z, w, p["lm_head.b"]) if "lm_head.b" in p else z @ w


def pick(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator, top_p: float = 1.0,
         limit: int | None = None) -> int:
    """One token id from next-token logits (V,): only ids < limit; temperature (0: greedy), top-k (0: all),
    top-p (1: all; else the fewest most likely ids whose probability reaches p), as nanoGPT."""
    z = logits[:limit] if limit is not None else logits
    if temperature == 0:
        return int(np.argmax(z))
    z = z / np.float32(temperature)
    if 0 < top_k < z.size:
        z = np.where(z < np.partition(z, -top_k)[-top_k], np.float32(-np.inf), z)
    p = np.exp(z - z.max())
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order])
        kept = mass - p[order] < np.float32(top_p) * mass[-1]    # the id that crosses p stays in
        p[order[~kept]] = 0
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), z.size - 1))


def generate(params: np.ndarray, cfg: ModelConfig, prompt: list[int], tokens: int, temperature: float, top_k: int,
             seed: int, cache: bool = True, top_p: float = 1.0, limit: int | None = None, on_token=None) -> list[int]:
    """`tokens` new ids after `prompt`, each from the last seq_len ids (with a KV cache until the window
    is full; after that every position shifts, so each step recomputes the window, as nanoGPT does).
    `params`: the flat 1-rank parameter buffer; `limit`: ids at or beyond it are never drawn;
    `on_token(seq)`: called with the sequence so far after each new id (to stream it)."""
    rng, T, seq = np.random.default_rng(seed), cfg.seq_len, list(prompt)
    layout = Layout.for_model(cfg, 1)
    kv = KVCache(layout.views(params), cfg)
    step = (lambda: kv.forward(seq[-T:], last=True)[-1]) if cache else \
        (lambda: full_logits(layout.groups(params), np.array([seq[-T:]], dtype=np.int32), cfg)[-1])
    for _ in range(tokens):
        if cache and 0 < kv.n < T:   # the newest id joins the cache
            z = kv.forward(seq[-1:])[-1]
        else:   # the first id, or the window moved on: the whole window again
            kv.reset()
            z = step()
        seq.append(pick(z, temperature, top_k, rng, top_p, limit))
        if on_token is not None:
            on_token(seq)
    return seq[len(prompt):]
