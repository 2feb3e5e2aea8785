"""Synthetic corpus and the distributed data stream.

How it works: docs/design.md, "Inside the step", data/synthetic.py."""

import numpy as np

from capstone.config import ConfigError

PHRASES = 16
PHRASE_LEN = 8


def make_corpus(seed: int, total_tokens: int, vocab_size: int = 64) -> np.ndarray:
    """Deterministic int32 token stream of length total_tokens with learnable structure."""
    if total_tokens < 2:
        raise ValueError(f"total_tokens must be >= 2, got {total_tokens}")
    rng = np.random.default_rng([seed, 0xC0])
    phrases = rng.integers(0, vocab_size, size=(PHRASES, PHRASE_LEN), dtype=np.int32)
    return phrases[rng.integers(0, PHRASES, size=-(-total_tokens // PHRASE_LEN))].reshape(-1)[:total_tokens]


class Windows:
    """Batches as both sources serve them (DataStream, capstone.data.tokens.TokenData): training sample i is
    window perm_e[i mod n_windows] of T+1 tokens of `self.train` (perm_e: seeded, for epoch i // n_windows)."""

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:   # a batch spans at most a few epochs; keep the cache small
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng([self.seed, 0xDA7A, epoch]).permutation(self.n_windows)
        return self._perms[epoch]

    def _windows(self, tokens, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        windows = tokens[starts[:, None] + np.arange(self.T + 1)].astype(np.int32)   # (count, T+1), reads only these
        return windows[:, :-1], windows[:, 1:]

    def samples(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets (count, T) int32 for global training samples [first, first+count)."""
        if first < 0 or count < 0:
            raise ValueError(f"first and count must be >= 0, got {first} and {count}")
        epochs, within = np.divmod(np.arange(first, first + count, dtype=np.int64), self.n_windows)
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            windows[sel] = self._perm(epoch)[within[sel]]
        return self._windows(self.train, windows * self.T)

    def micro_batch(self, cursor: int, micro: int, rank: int, world: int):
        """Rank `rank`'s micro-batch `micro` of the step whose first global sample is `cursor`."""
        return self.samples(cursor + (micro * world + rank) * self.B, self.B)


class DataStream(Windows):
    """Batches of (inputs, targets) as a pure function of (corpus, seed, global sample index)."""

    def __init__(self, corpus: np.ndarray, seq_len: int, batch_size: int, seed: int, eval_sequences: int = 32):
        self.train, self.T, self.B, self.seed = corpus, seq_len, batch_size, seed   # held-out windows at its end
        self.n_windows = (len(corpus) - 1) // seq_len - eval_sequences
        if self.n_windows < 1:
            raise ConfigError(f"a corpus of {len(corpus)} tokens holds fewer than {eval_sequences + 1} sequences of "
                             f"{seq_len + 1} tokens (training plus the held-out evaluation batch); raise --corpus-tokens")
        self._perms: dict[int, np.ndarray] = {}

    def val_batch(self, k: int, count: int, rank: int = 0, world: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Rows rank, rank+world, ... of held-out batch k (windows k*count .. (k+1)*count-1 of the held-out part)."""
        return self._windows(self.train, (self.n_windows + k * count + np.arange(count)[rank::world]) * self.T)
