"""Token data prepared by `python -m capstone.prepare` (docs/data.md), char or BPE.

`load_meta(DIR)` (capstone.data.dataset) reads and strictly checks DIR/meta.json.
`TokenData` memory-maps DIR/train.bin and DIR/val.bin read-only and serves batches with the same
interface and sample indexing as `capstone.data.DataStream`: sample i is a window of T+1 tokens
chosen by a seeded per-epoch permutation of the non-overlapping windows of train.bin, so batches
are a pure function of (data, seed, global sample index). Validation batches come from a fixed
permutation of val.bin's windows that does not depend on the seed.
"""

import hashlib
import os

import numpy as np

from capstone.config import ConfigError
from capstone.data.synthetic import Windows
from capstone.data.dataset import DatasetError, Split, _check, identity, invalid, load_meta  # noqa: F401 (re-exported)

DTYPE = np.dtype("<u2")         # uint16, little-endian
VAL_KEY = 0x5EA1                # key of the fixed validation permutation (not the training seed)
EVAL_WINDOWS = 32               # eval_batch size, as DataStream's eval_sequences (capstone.data.synthetic)
CHUNK = 1 << 20                 # bytes per read when hashing / range-checking a .bin


def _memmap(split: Split) -> np.memmap:
    try:
        size = os.path.getsize(split.path)
    except OSError:
        raise invalid(split.path, "missing or unreadable") from None
    _check(size == split.tokens * DTYPE.itemsize, split.path,
           f"{size} bytes, but meta.json says {split.tokens} tokens = {split.tokens * DTYPE.itemsize} bytes")
    _check(split.tokens >= 2, split.path, f"holds {split.tokens} tokens, fewer than one input and one target")
    return np.memmap(split.path, dtype=DTYPE, mode="r", shape=(split.tokens,))


class TokenData(Windows):
    """Training and validation batches from a prepared dataset, like DataStream (same indexing)."""

    def __init__(self, directory: str, seq_len: int, batch_size: int, seed: int):
        if seq_len < 1 or batch_size < 1:
            raise ConfigError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
        self.meta = load_meta(directory)
        self.T, self.B, self.seed = seq_len, batch_size, seed
        self.train, self.val = _memmap(self.meta.train), _memmap(self.meta.val)
        self.n_windows, self.n_val_windows = ((s.tokens - 1) // seq_len for s in (self.meta.train, self.meta.val))
        short = min((self.meta.train, self.meta.val), key=lambda split: split.tokens)
        if short.tokens - 1 < seq_len:   # the dataset is fine: the window is too long for it
            raise ConfigError(f"--seq-len {seq_len} is too long for {directory}: {short.path} holds {short.tokens} "
                              f"tokens, fewer than one window of seq_len+1 = {seq_len + 1}. Pass --seq-len "
                              f"{max(1, short.tokens - 1)} or less, or prepare a longer text.")
        self._perms: dict[int, np.ndarray] = {}
        self._val_perm = np.random.default_rng([VAL_KEY, self.n_val_windows]).permutation(self.n_val_windows)

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    def verify(self) -> "TokenData":
        """Check each .bin's sha256 against meta.json and every token id < vocab_size (chunked reads)."""
        for split in (self.meta.train, self.meta.val):
            h, top = hashlib.sha256(), -1
            with open(split.path, "rb") as f:
                while block := f.read(CHUNK):
                    h.update(block)
                    top = max(top, int(np.frombuffer(block, dtype=DTYPE).max()))
            _check(h.hexdigest() == split.sha256, split.path,
                   f"sha256 {h.hexdigest()} does not match meta.json ({split.sha256}): the file is corrupt or replaced")
            _check(top < self.vocab_size, split.path, f"holds token id {top} >= vocab_size {self.vocab_size}")
        return self

    def identity(self) -> dict:
        """What a run records in every checkpoint under "data" and a resume compares: the dataset's
        digests, vocabulary size and tokenizer (`capstone.data.dataset.identity`)."""
        return identity(self.meta)

    def encode(self, text: str) -> np.ndarray:
        try:
            return self.meta.tokenizer.encode(text)
        except ValueError as exc:
            raise ValueError(f"{exc} (dataset {self.meta.directory})") from None

    def decode(self, ids) -> str:
        return self.meta.decode(ids)

    def val_batch(self, k: int, count: int, rank: int = 0, world: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Rows rank, rank+world, ... of validation batch k: windows k*count .. (k+1)*count-1 of a fixed
        permutation of val.bin's windows (wrapping around); batches 0..M-1 are distinct while M*count <= n_val_windows."""
        if k < 0 or not 1 <= count <= self.n_val_windows:
            raise ConfigError(f"validation batch {k} of {count} windows: need k >= 0 and 1 <= count <= "
                              f"{self.n_val_windows} (the windows of seq_len+1 tokens in {self.meta.val.path})")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world), got rank {rank} of world {world}")
        index = (k * count + np.arange(count, dtype=np.int64)[rank::world]) % self.n_val_windows
        return self._windows(self.val, self._val_perm[index] * self.T)

    def eval_batch(self, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
        """DataStream's fixed held-out batch: rank `rank`'s rows of val_batch(0, EVAL_WINDOWS) (fewer if val is short)."""
        return self.val_batch(0, min(EVAL_WINDOWS, self.n_val_windows), rank, world)
