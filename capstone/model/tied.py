"""--tie-embeddings: the LM head is the token embedding wte, as GPT-2's (imported only when on).

The tied model has no lm_head.w (capstone.model.params): its head computes z = ln_f(x) @ wte.T
(+ lm_head.b), reading wte from the embedding group through the seam (capstone.model.seam; at
ZeRO-3 the group is gathered for it, asked for as a backward's so nothing is prefetched after it).
wte's gradient is the sum of its two uses: the head's backward (first in the backward pass) makes
its share, a (V, C) array the pass's `Tie` carries to the embedding's backward (last), which adds
it to the embedding's own before the group's gradient lands, so every reducer, ZeRO stage and
accumulation sees one gradient of wte, as for any parameter. Both are the one model's layers with
the pass's tie as an input (capstone.model.backward). Under tensor parallelism the embedding and
head are whole on every rank, as they are untied. Under a pipeline the two uses are on the first
and last stages: the model's tie source is then capstone.parallel.tiedstages's `Link`, whose ties
read the last stage's copy of wte and hand the head's share to the first stage.
"""

import numpy as np


class Tie:
    """One pass's tied wte: its shape (V, C), and the head's share of its gradient until the embedding's backward."""

    def __init__(self, shape: tuple):
        self.shape, self.grad = shape, None

    def wte(self, seam) -> np.ndarray:
        """wte (V, C): the embedding group's first array (the caller releases "embed")."""
        return seam.weights("embed", True)[:self.shape[0] * self.shape[1]].reshape(self.shape)

    def made(self, grad: np.ndarray) -> None:
        """The head's backward has made its share: here it waits for the embedding's."""
        self.grad = grad

    def share(self) -> np.ndarray | None:
        """The head's share of wte's gradient for the embedding's backward (None: no head in this pass)."""
        grad, self.grad = self.grad, None
        return grad


class Tied:
    """The model's tie source on one rank: a fresh `Tie` for each pass."""

    def __init__(self, shape: tuple):
        self.shape = shape

    def for_pass(self) -> Tie:
        return Tie(self.shape)
