"""Training data: the synthetic corpus, prepared token files, and the held-out evaluation set.

`open_data` picks the source of a run; both kinds serve batches with the same interface, indexed by
the global sample (capstone.data.synthetic).
"""

from capstone.config import ConfigError
from capstone.data.synthetic import DataStream, make_corpus


def open_data(mcfg, tcfg, batch_size: int):
    """(data, identity) of these configs: a prepared directory (`tcfg.data`, verified) or the
    synthetic corpus, both with the same interface; `identity` is what a resume must match."""
    eval_sequences = tcfg.eval_batches * tcfg.eval_batch_size
    if tcfg.data:
        from capstone.data.tokens import TokenData
        data = TokenData(tcfg.data, mcfg.seq_len, batch_size, tcfg.seed).verify()
        if data.vocab_size > mcfg.vocab_size:
            raise ConfigError(f"{tcfg.data} has {data.vocab_size} distinct tokens but --vocab-size is "
                              f"{mcfg.vocab_size}; leave --vocab-size out (it is taken from the data) or raise it.")
        if data.n_val_windows < tcfg.eval_batch_size:
            raise ConfigError(f"{tcfg.data}: the validation split holds {data.n_val_windows} sequences of "
                              f"{mcfg.seq_len + 1} tokens, fewer than --eval-batch-size {tcfg.eval_batch_size}. "
                              f"Pass --eval-batch-size {data.n_val_windows} or less, --seq-len "
                              f"{max(1, (data.meta.val.tokens - 1) // tcfg.eval_batch_size)} or less, or prepare "
                              f"a longer text.")
        return data, {**data.identity(), "seed": tcfg.seed}
    corpus = make_corpus(tcfg.corpus_seed, tcfg.corpus_tokens, mcfg.vocab_size)
    identity = {"seed": tcfg.seed, "corpus_seed": tcfg.corpus_seed, "corpus_tokens": tcfg.corpus_tokens,
                "eval_sequences": eval_sequences}
    return DataStream(corpus, mcfg.seq_len, batch_size, tcfg.seed, eval_sequences), identity
