"""Which tokenizer decodes a checkpoint's token ids, and the refusal of a dataset it was not trained on.

A checkpoint written since the BPE change records its dataset's identity (capstone.data.dataset.identity)
with the tokenizer itself, so it decodes on its own. An older one records only digests (vocabulary size,
sha256 of the characters, of each split): the prepared dataset is found from the run's --data path and
must match them. A dataset passed with --data must match whatever the checkpoint records; the refusal
names each difference (tokenizer kind, which characters, the text of each split).
"""

import os
import pathlib
from dataclasses import dataclass

from capstone.flags import paths
from capstone.config import ConfigError, ModelConfig
from capstone.data.dataset import META_FILE, identity, load_meta
from capstone.data.tokenizer import BPETokenizer, CharTokenizer, difference, from_description

NOT_COMPARED = {"seed", "tokenizer"}    # the training seed is not the data's; the tokenizer is compared by kind/sha


class SampleError(Exception):
    """Sampling cannot go on; `code` is the exit status, the message says what to do."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Vocab:
    """The tokenizer to decode with, and where it came from (for the stderr line and errors)."""

    tokenizer: CharTokenizer | BPETokenizer
    source: str


def _short(value) -> str:
    text = str(value)
    return text[:16] + "..." if len(text) > 24 else text


def differences(recorded: dict, found: dict) -> list[str]:
    """What differs between the identity a checkpoint recorded and a dataset's, key by key, in words
    (only the keys the checkpoint has: an older one records fewer)."""
    out = []
    if "tokenizer" in recorded:
        mine, theirs = from_description(recorded["tokenizer"]), from_description(found["tokenizer"])
        out += [d for d in [difference(mine, theirs)] if d]
    elif recorded.get("chars_sha256") != found.get("chars_sha256"):
        out.append(f"the checkpoint's vocabulary has {recorded.get('vocab_size')} characters (sha256 "
                   f"{_short(recorded.get('chars_sha256'))}), the dataset's {found['vocab_size']} "
                   f"{'tokens' if 'tokenizer_sha256' in found else 'characters'} (sha256 "
                   f"{_short(found.get('chars_sha256') or found.get('tokenizer_sha256'))})")
    names = {"train_sha256": "train.bin", "val_sha256": "val.bin"}
    skip = NOT_COMPARED | {"chars_sha256", "tokenizer_sha256", "digest", "version"} | (
        {"vocab_size", "format"} if out else set())          # implied by the tokenizer's difference
    for key in sorted(set(recorded) - skip):
        if recorded[key] != found.get(key):
            what = f"{names[key]} (the text)" if key in names else key
            out.append(f"{what} is {_short(recorded[key])} in the checkpoint but {_short(found.get(key))} in the dataset")
    return out


def _from_dataset(trained: str, data: str, ckpt: str, recorded: dict) -> Vocab:
    try:
        ds = load_meta(data)
    except ConfigError as exc:
        raise SampleError(2, f"{exc}") from None
    if diffs := differences(recorded, identity(ds)):
        own = " or drop --data (the checkpoint carries its vocabulary)" if "tokenizer" in recorded else ""
        raise SampleError(2, f"{data} is not the dataset {ckpt} was trained on: {'; '.join(diffs)}. Its token ids "
                             f"would decode to the wrong text. Pass --data with the dataset the run was trained on "
                             f"({trained}){own}.")
    return Vocab(ds.tokenizer, f"{ds.tokenizer.kind} vocabulary of {data}")


def _find_data(trained: str, ckpt: str) -> str:
    """The training run's prepared data: its data path `trained` as given, else relative to the run dir's
    ancestors (an absolute path: only itself, which os.path.join keeps)."""
    folder = os.path.dirname(os.path.abspath(ckpt))
    base = pathlib.Path(os.path.dirname(folder) if os.path.basename(folder) == "checkpoints" else folder).parent
    candidates = dict.fromkeys([trained] + [os.path.join(b, trained) for b in (base, *base.parents)])
    found = [d for d in candidates if paths.kind(d) is paths.Kind.DATASET]
    if not found:
        raise SampleError(2, f"{ckpt} was trained on the prepared data {trained!r} (relative to the training run's "
                             f"working directory) before checkpoints carried their vocabulary, and no {META_FILE} is "
                             f"there nor relative to the run directory's parents. Pass --data DIR: the directory "
                             f"`python -m capstone.prepare` wrote for that run (it is checked against the checkpoint).")
    return found[0]


def load_vocab(meta: dict, cfg: ModelConfig, data: str | None, ckpt: str) -> Vocab | None:
    """The checked tokenizer of the checkpoint (None: trained on the synthetic corpus, sample ids)."""
    recorded = meta.get("data") or {}
    if "tokenizer" not in recorded and "chars_sha256" not in recorded:
        if data is not None:
            raise SampleError(2, f"{ckpt} was trained on the synthetic corpus: its metadata holds no vocabulary, "
                                 f"so --data {data} cannot be checked against it. Drop --data to sample token ids "
                                 f"(--prompt-ids), or sample a checkpoint trained with --data.")
        return None
    if data is not None or "tokenizer" not in recorded:
        trained = (meta.get("train_config") or {}).get("data")   # the training run's --data
        vocab = _from_dataset(trained or "?", data or _find_data(trained or "", ckpt), ckpt, recorded)
    else:
        try:
            tok = from_description(recorded["tokenizer"])
        except ValueError as exc:
            raise SampleError(1, f"not a valid checkpoint: {ckpt}: its recorded tokenizer is unusable ({exc}); "
                                 f"sample with --data DIR, the dataset the run was trained on.") from None
        vocab = Vocab(tok, f"the checkpoint's own {tok.kind} vocabulary ({tok.vocab_size} tokens)")
    if cfg.vocab_size < vocab.tokenizer.vocab_size:
        raise SampleError(2, f"{ckpt}: the model has {cfg.vocab_size} output ids but its dataset's vocabulary "
                             f"{vocab.tokenizer.vocab_size} tokens; a checkpoint the trainer wrote never has this. "
                             f"Pass --data with the dataset the run was trained on.")
    return vocab
