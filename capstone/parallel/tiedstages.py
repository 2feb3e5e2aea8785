"""A tied head (--tie-embeddings) under a pipeline (--pp K, imported only then): wte on the first
and last stages (capstone.model.tied), the model's tie source on those stages.

The first stage holds wte as a parameter (its layout's "embed" group: the checkpoints stay the
1-rank model's, one wte, so a tied pipeline resumes on any grid and any grid on it); the last stage
holds a copy of it, refreshed from the first stage before each pass that reads it (a step's
forwards, an evaluation), so it is always the parameter the optimizer made, after an undo too.
The two ranks of a replica that exchange it are the pipeline group's first and last, which have
the same dp and tp coordinates: Megatron's embedding group. wte's gradient is the sum of its two
uses, as on one rank: the head's backward on the last stage sends its share of micro-batch j, and
the embedding's backward of micro-batch j on the first stage receives it and adds it to its own
before the group lands (every stage runs the backwards in the same order of micro-batches, so the
n-th share sent is the n-th received). So the first stage's reducer, ZeRO stage and accumulation
see one gradient of wte, as for any parameter, and at ZeRO-3 its shards are the one wte's.
"""

import numpy as np

from capstone.model.params import DTYPE
from capstone.model.tied import Tie
from capstone.parallel.pipeline import drain

WTE_TAG, SHARE_TAG = 30001, 30002   # wte to the last stage; the head's share of its gradient back


class Link:
    """The model's tie source on a pipeline stage (capstone.model.tied.Tied's role), with the exchange of
    wte and its gradient between the first and last stages; `seam` is the stage's (it holds wte on the first)."""

    def __init__(self, seam, pp, shape: tuple, share_buffer=np.empty_like):
        self.seam, self.pp, self.shape, self.share_buffer = seam, pp, shape, share_buffer   # the share's (per chunk)
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1
        self.mirror, self.sends = np.empty(shape, dtype=DTYPE) if self.last else None, []

    def for_pass(self) -> Tie:
        return StageTie(self.shape, self)

    def refresh(self) -> None:
        """Collective over the first and last stages: the last stage's copy of wte set to the first's."""
        if self.first:
            wte = self.seam.weights("embed", True)[:self.shape[0] * self.shape[1]]
            self.pp.wait(self.pp.Isend(wte, self.pp.size - 1, WTE_TAG), "send of wte to the last pipeline stage",
                         "tied_send", "p2p", wte.nbytes)
            self.seam.release("embed")
        elif self.last:
            self.pp.wait(self.pp.Irecv(self.mirror, 0, WTE_TAG), "receive of wte from the first pipeline stage",
                         "tied_recv", "p2p", self.mirror.nbytes)

    def receive_share(self) -> np.ndarray:
        """The first stage: the last stage's share of wte's gradient of the same micro-batch."""
        buf = self.share_buffer(np.empty(self.shape, dtype=DTYPE))
        self.pp.wait(self.pp.Irecv(buf, self.pp.size - 1, SHARE_TAG), "receive of the tied head's gradient of wte "
                     "from the last pipeline stage", "tied_recv", "p2p", buf.nbytes)
        return buf

    def drain(self) -> None:
        """Wait for the shares sent (under the deadline)."""
        drain(self.pp, self.sends, "send of the tied head's gradient of wte to the first stage", "tied_send")


class StageTie(Tie):
    """One pass's tied wte on a pipeline stage: the last stage reads its copy and sends its share;
    the first stage receives the share for its embedding's backward."""

    def __init__(self, shape: tuple, link: Link):
        super().__init__(shape)
        self.link = link

    def wte(self, seam) -> np.ndarray:
        return self.link.mirror if self.link.last else super().wte(seam)

    def made(self, grad: np.ndarray) -> None:
        """The head's share of wte's gradient (the head is the last stage's) to the first stage (waited for in
        `Link.drain`)."""
        self.link.sends.append((self.link.pp.Isend(grad, 0, SHARE_TAG), grad))

    def share(self) -> np.ndarray | None:
        return self.link.receive_share() if self.link.first else super().share()
