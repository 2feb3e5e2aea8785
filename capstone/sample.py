"""`python -m capstone.sample RUN_DIR|CKPT`: generate text from a checkpoint in one process (no MPI).

Reads a sharded checkpoint of any world size with serial h5py, refuses it exactly when
`python -m capstone.checkpoint verify` does, reassembles the master parameters and samples
autoregressively (temperature, top-k, seeded), with a KV cache; the context is cropped to the
last seq_len tokens as in nanoGPT. Token ids become text through the prepared dataset's meta.json,
checked against the checkpoint's vocabulary digest; a synthetic-corpus checkpoint samples ids.
Exit codes: 0 ok; 1 not a valid checkpoint; 2 bad arguments, missing data or vocabulary mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time

import numpy as np

from capstone.checkpoint import CheckpointError, files
from capstone.checkpoint.__main__ import checks, load_all
from capstone.config import ConfigError, ModelConfig
from capstone.model.ops import layer_norm, linear, linear_gelu
from capstone.model.gpt import logits as full_logits
from capstone.model.params import Layout
from capstone.data.tokens import META_FILE, Meta, load_meta


class SampleError(Exception):
    """Sampling cannot go on; `code` is the exit status, the message says what to do."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def resolve(target: str) -> str:
    """The checkpoint file: `target` itself, or the one RUN_DIR/checkpoints/latest names."""
    if os.path.isfile(target):
        return target
    if not os.path.isdir(target):
        raise SampleError(2, f"{target}: no such file or directory; pass a run directory (--out of the "
                             f"training run) or a ckpt-*.h5 file.")
    for directory in (os.path.join(target, "checkpoints"), target):
        try:
            path = files.read_pointer(directory)
        except (ValueError, OSError) as exc:
            raise SampleError(2, f"{exc}") from None
        if path:
            return path
    raise SampleError(2, f"{target} has no checkpoints/latest: the run wrote no checkpoint yet. Pass a "
                         f"ckpt-*.h5 file, or train with --ckpt-every K first.")


def load_checkpoint(path: str) -> tuple[dict, ModelConfig, np.ndarray]:
    """(metadata, model config, named float32 parameters) of a checkpoint that passes every digest check."""
    try:
        meta, results = load_all(path)
        bad = [line for good, line in checks(path, meta, results, sealed=True) if not good]  # verify's own checks
    except CheckpointError as exc:
        text = str(exc)
        raise SampleError(1, text if text.startswith("not a valid checkpoint") else f"not a valid checkpoint: {text}") from None
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise SampleError(1, f"not a valid checkpoint: {path} is unreadable ({type(exc).__name__}: {exc}); "
                             f"sample from an earlier checkpoint.") from None
    if bad:
        raise SampleError(1, f"not a valid checkpoint: {path}: " + "; ".join(bad) + "\nSample from an earlier "
                             f"checkpoint; `python -m capstone.checkpoint verify {path}` lists every check.")
    names = sorted(meta["datasets"], key=lambda n: meta["datasets"][n]["offset"])
    flat = np.concatenate([results[n][2][0] for n in names])[:meta["n_params"]].astype(np.float32, copy=False)
    try:
        cfg = ModelConfig(**meta["model_config"])
    except (ConfigError, TypeError) as exc:
        raise SampleError(1, f"{path}: model_config {meta.get('model_config')} is not one this capstone "
                             f"builds ({exc}); sample with the capstone version that wrote it.") from None
    layout = Layout.for_model(cfg, 1)
    if json.loads(layout.to_json()) != meta["layout"] or layout.padded != flat.size:
        raise SampleError(1, f"{path}: its parameter layout differs from the one capstone builds for "
                             f"{meta['model_config']}; sample with the capstone version that wrote it.")
    return meta, cfg, np.ascontiguousarray(flat)


def chars_sha256(vocab: Meta) -> str:
    return hashlib.sha256("".join(vocab.chars).encode("utf-8")).hexdigest()


def data_candidates(trained: str, ckpt: str) -> list[str]:
    """Where the training run's data path may be: as given, then relative to the run dir's ancestors."""
    if os.path.isabs(trained):
        return [trained]
    folder = os.path.dirname(os.path.abspath(ckpt))
    run_dir = os.path.dirname(folder) if os.path.basename(folder) == "checkpoints" else folder
    out, base = [trained], os.path.dirname(run_dir)
    while True:
        out.append(os.path.join(base, trained))
        if os.path.dirname(base) == base:
            return list(dict.fromkeys(out))
        base = os.path.dirname(base)


def load_vocab(meta: dict, cfg: ModelConfig, data: str | None, ckpt: str) -> Meta | None:
    """The checked vocabulary of the checkpoint (None: trained on the synthetic corpus, sample ids)."""
    identity = meta.get("data") or {}
    trained = (meta.get("train_config") or {}).get("data") or ""
    if "chars_sha256" not in identity:
        if data is not None:
            raise SampleError(2, f"{ckpt} was trained on the synthetic corpus: its metadata holds no vocabulary "
                                 f"digest, so --data {data} cannot be checked against it. Drop --data to sample "
                                 f"token ids (--prompt-ids), or sample a checkpoint trained with --data.")
        return None
    if data is None:
        found = [d for d in data_candidates(trained, ckpt) if os.path.isfile(os.path.join(d, META_FILE))]
        if not found:
            raise SampleError(2, f"{ckpt} was trained on the prepared data {trained!r} (relative to the training "
                                 f"run's working directory), but no {META_FILE} is there nor relative to the run "
                                 f"directory's parents. Pass --data DIR: the directory `python -m capstone.prepare` "
                                 f"wrote for that run (its vocabulary is checked).")
        data = found[0]
    try:
        vocab = load_meta(data)
    except ConfigError as exc:
        raise SampleError(2, f"{exc}") from None
    have = (vocab.vocab_size, chars_sha256(vocab))
    want = (identity.get("vocab_size"), identity["chars_sha256"])
    if have != want or cfg.vocab_size != vocab.vocab_size:
        raise SampleError(2, f"vocabulary mismatch: {data}/{META_FILE} has {have[0]} characters (sha256 "
                             f"{have[1][:16]}...) but {ckpt} was trained on {want[0]} (sha256 {str(want[1])[:16]}..., "
                             f"model vocab_size {cfg.vocab_size}), so its token ids would decode to the wrong "
                             f"characters. Pass --data with the dataset the run was trained on ({trained or '?'}).")
    return vocab


class KVCache:
    """Incremental forward of MiniGPT (batch 1): keys and values of earlier positions are kept per layer,
    so each new position costs one row of every matmul. Same math as `capstone.model.logits`."""

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
            a = layer_norm(x, p[h + "ln_1.w"], p[h + "ln_1.b"])
            y = self._attend(i, linear(a, p[h + "attn.c_attn.w"], p[h + "attn.c_attn.b"]), top)
            x = (x[-1:] if top else x) + linear(y, p[h + "attn.c_proj.w"], p[h + "attn.c_proj.b"])
            u = linear_gelu(layer_norm(x, p[h + "ln_2.w"], p[h + "ln_2.b"]), p[h + "mlp.c_fc.w"], p[h + "mlp.c_fc.b"])
            x = x + linear(u, p[h + "mlp.c_proj.w"], p[h + "mlp.c_proj.b"])
        self.n = s + n
        return linear(layer_norm(x, p["ln_f.w"], p["ln_f.b"]), p["lm_head.w"], p["lm_head.b"])


def pick(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    """One token id from next-token logits (V,): temperature (0: greedy), top-k (0: all), as nanoGPT."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / np.float32(temperature)
    if 0 < top_k < z.size:
        z = np.where(z < np.partition(z, -top_k)[-top_k], np.float32(-np.inf), z)
    cdf = np.cumsum(np.exp(z - z.max()))
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), z.size - 1))


def generate(params: np.ndarray, cfg: ModelConfig, prompt: list[int], tokens: int, temperature: float,
             top_k: int, seed: int, cache: bool = True) -> list[int]:
    """`tokens` new ids after `prompt`, each from the last seq_len ids (with a KV cache until the window
    is full; after that every position shifts, so each step recomputes the window, as nanoGPT does).
    `params`: the flat 1-rank parameter buffer."""
    rng, T, seq = np.random.default_rng(seed), cfg.seq_len, list(prompt)
    layout = Layout.for_model(cfg, 1)
    kv = KVCache(layout.views(params), cfg)
    step = (lambda: kv.forward(seq[-T:], last=True)[-1]) if cache else \
        (lambda: full_logits(layout.groups(params), np.array([seq[-T:]], dtype=np.int32), cfg)[-1])
    z = step()
    for i in range(tokens):
        seq.append(pick(z, temperature, top_k, rng))
        if i + 1 == tokens:
            break
        if cache and kv.n < T:
            z = kv.forward(seq[-1:])[-1]
        else:
            kv.reset()
            z = step()
    return seq[len(prompt):]


def prompt_ids(args, vocab: Meta | None, V: int) -> list[int]:
    """The prompt as token ids: --prompt-ids, else --prompt encoded (default: a newline, else id 0)."""
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise SampleError(2, f"--prompt-ids {args.prompt_ids!r}: expected integers like \"1 2 3\".") from None
        bad = [t for t in ids if not 0 <= t < V]
        if not ids or bad:
            raise SampleError(2, f"--prompt-ids needs at least one id, each in [0, {V}); got {ids}.")
        return ids
    if vocab is None:
        if args.prompt is not None:
            raise SampleError(2, "this checkpoint was trained on the synthetic corpus (no vocabulary): give the "
                                 "prompt as token ids, e.g. --prompt-ids \"1 2 3\".")
        return [0]
    text = args.prompt if args.prompt is not None else ("\n" if "\n" in vocab.chars else vocab.chars[0])
    if not text:
        raise SampleError(2, "--prompt is empty: give at least one character (e.g. --prompt \"\\n\").")
    try:
        return vocab.encode(text).tolist()
    except ValueError as exc:
        raise SampleError(2, f"--prompt: {exc}.") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m capstone.sample", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate text from a capstone checkpoint on one process (no mpirun). See docs/sampling.md.")
    p.add_argument("target", metavar="RUN_DIR_or_CKPT",
                   help="a training run directory (its checkpoints/latest is used) or a ckpt-*.h5 file")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=argparse.SUPPRESS, help="text to continue (default: a newline)")
    g.add_argument("--prompt-ids", default=argparse.SUPPRESS, metavar="\"ID ID ...\"",
                   help="the prompt as space-separated token ids (needed for a synthetic-corpus checkpoint)")
    p.add_argument("--tokens", type=int, default=500, help="number of new tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="divide the logits by this (0: greedy)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens only (0: all)")
    p.add_argument("--seed", type=int, default=1, help="seed of the sampler: the same seed gives the same text")
    p.add_argument("--data", default=argparse.SUPPRESS, metavar="DIR",
                   help="prepared dataset whose meta.json gives the vocabulary (default: the training run's)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context every token (slower)")
    return p


def run(args) -> int:
    if args.tokens < 0 or args.temperature < 0 or args.top_k < 0:
        raise SampleError(2, "--tokens, --temperature and --top-k must be >= 0.")
    path = resolve(args.target)
    meta, cfg, params = load_checkpoint(path)
    vocab = load_vocab(meta, cfg, args.data, path)
    prompt = prompt_ids(args, vocab, cfg.vocab_size)
    start, cpu = time.perf_counter(), time.process_time()
    new = generate(params, cfg, prompt, args.tokens, args.temperature, args.top_k, args.seed, not args.no_kv_cache)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if vocab is None:
        print(" ".join(map(str, prompt + new)))
    else:
        print(vocab.decode(prompt + new))
    source = "token ids (synthetic-corpus checkpoint)" if vocab is None else f"vocabulary {vocab.directory}"
    print(f"# {path}: step {meta['step']}, {meta['world_size']} ranks; {len(new)} tokens in {seconds:.2f} s "
          f"(CPU {cpu:.2f} s); "
          f"{source}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = argparse.Namespace(prompt=None, prompt_ids=None, data=None)
    build_parser().parse_args(argv, namespace=args)
    try:
        return run(args)
    except SampleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
