"""`python -m capstone.sample RUN_DIR|CKPT`: generate text from a checkpoint in one process (no MPI).

Reads a sharded checkpoint of any world size with serial h5py, refuses it exactly when
`python -m capstone.checkpoint verify` does, reassembles the master parameters and samples
(capstone.gpt2.generate: temperature, top-k, top-p, seeded, KV cache). A checkpoint records its dataset's
tokenizer, so it decodes on its own; older ones (and --data) use a prepared dataset, which must be the
one the run was trained on (capstone.gpt2.vocab). Every flag is checked first. Exit codes: 0 ok; 1 not a
valid checkpoint; 2 bad arguments, missing data or a different dataset.
"""

import argparse
import math
import sys
import time

import numpy as np

from capstone.checkpoint import CheckpointError, serial
from capstone.config import ConfigError, ModelConfig
from capstone.gpt2.generate import KVCache, generate, pick  # noqa: F401  (capstone.sample.KVCache etc., as before)
from capstone.flags.pipe import fail, run_tool
from capstone.gpt2.vocab import SampleError, Vocab, load_vocab


def resolve(target: str, tool: str = "sample") -> str:
    """The checkpoint file: `target` itself, or the one RUN_DIR/checkpoints/latest names (exit 2 for a path
    that names none, 1 for a `latest` that names no checkpoint file; `tool`: who asks, for the messages)."""
    try:
        return serial.find(target, tool)
    except (ConfigError, CheckpointError) as exc:
        raise SampleError(2 if isinstance(exc, ConfigError) else 1, str(exc)) from None


def load_checkpoint(path: str) -> tuple[dict, ModelConfig, np.ndarray]:
    """(metadata, model config, float32 parameters) of a checkpoint that passes every digest check."""
    try:
        return serial.load_weights(path)
    except CheckpointError as exc:
        raise SampleError(1, str(exc)) from None


MAX_SAMPLES = 10000
TOP_K = 40                      # --top-k when not given (at most the vocabulary size)


def _prompt_text(args) -> str | None:
    """--prompt, or the UTF-8 text of --prompt-file (None if neither)."""
    if args.prompt_file is None:
        return args.prompt
    try:
        with open(args.prompt_file, "rb") as f:
            return f.read().decode("utf-8")
    except OSError as exc:
        raise SampleError(2, f"--prompt-file {args.prompt_file}: {exc.strerror}; pass a readable UTF-8 text "
                             f"file.") from None
    except UnicodeDecodeError as exc:
        raise SampleError(2, f"--prompt-file {args.prompt_file} is not UTF-8 (byte offset {exc.start}); convert "
                             f"it, e.g. with iconv, or pass --prompt.") from None


def prompt_ids(args, vocab: Vocab | None, limit: int) -> list[int]:
    """The prompt as token ids: --prompt-ids, else --prompt / --prompt-file encoded (default: a newline, else id 0)."""
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            raise SampleError(2, f"--prompt-ids {args.prompt_ids!r}: expected integers like \"1 2 3\".") from None
        if not ids or any(not 0 <= t < limit for t in ids):
            raise SampleError(2, f"--prompt-ids needs at least one id, each in [0, {limit}); got {ids}.")
        return ids
    text = _prompt_text(args)
    if vocab is None:
        if text is not None:
            raise SampleError(2, "this checkpoint was trained on the synthetic corpus (no vocabulary): give the "
                                 "prompt as token ids, e.g. --prompt-ids \"1 2 3\".")
        return [0]
    if text is None:
        text = "\n" if vocab.tokenizer.kind == "bpe" or "\n" in vocab.tokenizer.chars else vocab.tokenizer.chars[0]
    if not text:
        raise SampleError(2, "the prompt is empty: give at least one character (e.g. --prompt \"\\n\").")
    try:
        return vocab.tokenizer.encode(text).tolist()
    except ValueError as exc:
        raise SampleError(2, f"the prompt: {exc} ({vocab.source}).") from None


def check_args(args) -> None:
    """Every numeric flag in range, before anything is read (exit 2 with what to pass instead)."""
    bad = [text for wrong, text in (
        (args.tokens < 1, f"--tokens {args.tokens}: generate at least 1 token"),
        (not (math.isfinite(args.temperature) and args.temperature >= 0),
         f"--temperature {args.temperature}: must be a finite number >= 0 (0: greedy; 0.8 is typical)"),
        (args.top_k is not None and args.top_k < 0, f"--top-k {args.top_k}: must be >= 0 (0: all tokens)"),
        (not (math.isfinite(args.top_p) and 0 < args.top_p <= 1),
         f"--top-p {args.top_p}: must be in (0, 1] (1: off; 0.9 is typical)"),
        (args.seed < 0, f"--seed {args.seed}: must be an integer >= 0"),
        (not 1 <= args.num_samples <= MAX_SAMPLES, f"--num-samples {args.num_samples}: must be in [1, {MAX_SAMPLES}]"),
    ) if wrong]
    if bad:
        raise SampleError(2, "; ".join(bad) + ". See python -m capstone.sample --help.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m capstone.sample", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate text from a capstone checkpoint on one process (no mpirun). See docs/sampling.md.")
    p.add_argument("target", metavar="RUN_DIR_or_CKPT",
                   help="a training run directory (its checkpoints/latest is used) or a ckpt-*.h5 file")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=argparse.SUPPRESS, help="text to continue (default: a newline)")
    g.add_argument("--prompt-file", default=argparse.SUPPRESS, metavar="FILE", help="text to continue, from a UTF-8 file")
    g.add_argument("--prompt-ids", default=argparse.SUPPRESS, metavar="\"ID ID ...\"",
                   help="the prompt as space-separated token ids (needed for a synthetic-corpus checkpoint)")
    p.add_argument("--tokens", type=int, default=500, help="number of new tokens per sample")
    p.add_argument("--num-samples", type=int, default=1, help="samples to draw; sample i uses seed SEED+i")
    p.add_argument("--temperature", type=float, default=0.8, help="divide the logits by this (0: greedy)")
    p.add_argument("--top-k", type=int, default=argparse.SUPPRESS, help=f"sample among the k most likely tokens only (0: all; "
                                                          f"default {TOP_K}, or the vocabulary size if smaller)")
    p.add_argument("--top-p", type=float, default=1.0, help="then among the fewest most likely tokens whose "
                                                            "probability reaches p (1: all)")
    p.add_argument("--seed", type=int, default=1, help="seed of the sampler: the same seed gives the same text")
    p.add_argument("--data", default=argparse.SUPPRESS, metavar="DIR",
                   help="prepared dataset to decode with; it must be the run's (default: the checkpoint's own "
                        "vocabulary, or for older checkpoints the training run's --data)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context every token (slower)")
    return p


class Stream:
    """Prints a sample as it is made: the prompt, then each token's text once it decodes for good (a BPE
    token may end inside a character: the text is held until the next one completes it)."""

    def __init__(self, vocab: Vocab | None, prompt: list[int]):
        self.vocab, self.printed = vocab, ""
        self.show(prompt)

    def show(self, seq: list[int], end: str | None = None) -> None:
        """Print what the sample so far, `seq`, adds; `end` (it is whole): its cut last character too, then `end`."""
        text = " ".join(map(str, seq)) if self.vocab is None else self.vocab.tokenizer.decode(seq)
        text = text if end is not None else text.rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text
        if end is not None:
            print(end=end, flush=True)


def run(args) -> int:
    check_args(args)
    path = resolve(args.target)
    meta, cfg, params = load_checkpoint(path)
    vocab = load_vocab(meta, cfg, args.data, path)
    limit = vocab.tokenizer.vocab_size if vocab else cfg.vocab_size
    if args.top_k is not None and args.top_k > limit:
        raise SampleError(2, f"--top-k {args.top_k} is larger than the vocabulary ({limit} tokens); pass 0 (all) "
                             f"or at most {limit}.")
    top_k = min(TOP_K, limit) if args.top_k is None else args.top_k
    prompt = prompt_ids(args, vocab, limit)
    if len(prompt) > cfg.seq_len:
        print(f"note: the prompt is {len(prompt)} tokens, longer than the model's context (--seq-len {cfg.seq_len}): "
              f"it is printed whole, but the model sees only its last {cfg.seq_len} tokens.", file=sys.stderr)
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(args.num_samples):
        out = Stream(vocab, prompt)
        new = generate(params, cfg, prompt, args.tokens, args.temperature, top_k, args.seed + i, not args.no_kv_cache,
                       args.top_p, limit, on_token=out.show)
        out.show(prompt + new, "\n---------------\n" if i + 1 < args.num_samples else "\n")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    source = "token ids (synthetic-corpus checkpoint)" if vocab is None else vocab.source
    print(f"# {path}: step {meta['step']}, {meta['world_size']} ranks; {args.num_samples} x {args.tokens} tokens in "
          f"{seconds:.2f} s (CPU {cpu:.2f} s); {source}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = argparse.Namespace(prompt=None, prompt_ids=None, prompt_file=None, data=None, top_k=None)
    build_parser().parse_args(argv, namespace=args)
    try:
        return run(args)
    except (SampleError, ConfigError) as exc:   # ConfigError: e.g. a BPE checkpoint without the tokenizers library
        return fail(exc, exc.code if isinstance(exc, SampleError) else 2)


if __name__ == "__main__":
    sys.exit(run_tool(main))
