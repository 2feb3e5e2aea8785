"""Pipeline parallelism (--pp K, imported only then): the model's blocks in K contiguous stages.

Stage p of K holds the blocks of capstone.plan.stage_layers (balanced by layers; when K does not divide L the first
stages take one more, so the last stage, which also holds the final LayerNorm and the LM head,
has the fewer; --pp-layers gives the counts explicitly), the embedding with stage 0 and the head
with stage K-1: a stage is the one model (capstone.model.gpt.Model) over its groups, plus the
messages between stages. A pipeline group is the K ranks of the grid's pp axis; each stage's
optimizer state (ZeRO-1), gradient (ZeRO-2) and parameters (ZeRO-3) are sharded over its own
data-parallel group, and checkpointed in the canonical 1-rank layout (capstone.parallel.canonical).
At ZeRO-2/3 a stage's seam hands each micro-batch's gradient to the reducer as its backward makes
it, and at ZeRO-3 gathers each group for each micro-batch's forward and backward (the ranks of a
stage's data-parallel group run the same schedule, so their collectives come in the same order).

A step's micro-batches (--grad-accum m of them) go through the stages in the order of a
schedule (`order`): all forwards then all backwards (afab, GPipe's), or one forward one backward
(1f1b, as in Megatron-LM: stage p runs K-p-1 warm-up forwards, then alternates, so it holds the
activations of at most K-p micro-batches where afab holds m). Activations go forward and their
gradients backward between neighbouring stages as non-blocking point-to-point messages on the pp
communicator, each wait under the run's deadline. Each rank records when it computed what
(`events`, for the timeline picture and the bubble fraction, whose theory is (K-1)/(m+K-1)).
"""

import time
from typing import Callable

import numpy as np

from capstone.model.blocks import unpack
from capstone.model.params import DTYPE

EVAL_TAG = 30000   # the held-out evaluation's activations (training uses 2j forward, 2j+1 backward)


def order(schedule: str, p: int, K: int, m: int) -> list[tuple[str, int]]:
    """Stage p's sequence of ("F", j) forwards and ("B", j) backwards of micro-batches 0..m-1 (zb-h1: B is the input's
    gradient, ("W", j) the weights', held back p micro-batches: ZB-H1 of Qi et al., 1F1B's forwards and memory)."""
    if schedule == "afab":   # GPipe: every forward, then the backwards from the last micro-batch
        return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    warm, held = min(K - p - 1, m), []
    seq = [("F", j) for j in range(warm)]
    for j in range(m):
        seq += [("F", warm + j)] * (warm + j < m) + [("B", j)]
        held += [j] * (schedule == "zb-h1")
        if len(held) > p:
            seq.append(("W", held.pop(0)))
    return seq + [("W", j) for j in held]


def drain(pp, sends: list, what: str, kind: str) -> None:
    """Wait for `sends`, the (request, buffer) pairs in flight on `pp` (under the deadline), and forget them."""
    if sends:
        pp.wait([r for r, _ in sends], what, kind, "p2p", sum(a.nbytes for _, a in sends))
    sends.clear()


class Later(list):
    """A split backward's weight gradients (zb-h1): B keeps each group's writes (`group`: its `put`, as in
    capstone.model.backward), W (`land`) makes them into the seam's buffer and lands each group, in B's order."""

    def group(self, name: str, shapes) -> Callable:
        self.append((name, shapes, []))
        return lambda op, *operands: self[-1][2].append((op, operands))

    def land(self, seam, fresh: bool) -> None:
        for name, shapes, kept in self:
            gw = seam.grad_out(name, fresh)
            d = unpack(gw, shapes)
            for op, operands in kept:
                op(d, *operands)
            seam.landed(name, gw, fresh)


class Pipeline:
    """The step's micro-batches through the stages in a schedule's order (Sequential's interface):
    this rank's stage is the model over its stage's groups (`model.layout`), and the stages
    exchange activations and their gradients over `pp`."""

    def __init__(self, model, reducer, hooks, scale: float, schedule: str, pp, tie=None):
        """`tie`: a tied head's wte on the first and last stages (capstone.parallel.tiedstages.Link)."""
        self.model, self.reducer, self.hooks, self.scale, self.schedule = model, reducer, hooks, scale, schedule
        self.pp, self.p, self.K, self.tie = pp, pp.rank, pp.size, tie
        # sends: (request, buffer) in flight; events: (kind, j, t0, t1); span: the last step's forward_backward
        self.sends, self.events, self.span = [], [], (0.0, 0.0)

    def _recv(self, shape, peer: int, tag: int, what: str) -> np.ndarray:
        buf = np.empty(shape, dtype=DTYPE)
        self.pp.wait(self.pp.Irecv(buf, peer, tag), f"pipeline receive of {what} from stage {peer}",
                     "pipeline_recv", "p2p", buf.nbytes)
        return buf

    def _send(self, a, peer: int, tag: int) -> None:
        a = np.ascontiguousarray(a, dtype=DTYPE)
        self.sends.append((self.pp.Isend(a, peer, tag), a))

    def drain(self) -> None:
        """Wait for this stage's sends (under the deadline)."""
        drain(self.pp, self.sends, "pipeline sends to the neighbouring stages", "pipeline_send")

    def _received(self, x, tag: int, what: str):
        """The previous stage's activations for x's rows (stage 0: the scalar start of the pass)."""
        return 0.0 if self.p == 0 else self._recv((x.size, self.model.cfg.d_model), self.p - 1, tag, what)

    def forward(self, j: int, x, y):
        """Micro-batch j's forward on this stage; returns (its backward, the output's shape or the
        last stage's loss)."""
        x_in = self._received(x, 2 * j, f"micro-batch {j}'s activations")
        # zb-h1: the backward split as B and W (capstone.model.backward.weights_pass), W's work kept in `later`
        t0, later = time.perf_counter(), Later() if self.schedule == "zb-h1" else None
        out, backward = self.model.forward(x, y, self.scale, start=x_in, fresh=not self.reducer.accumulates,
                                           later=later)
        self.events.append(("F", j, t0, time.perf_counter()))
        if self.p < self.K - 1:
            self._send(out, self.p + 1, 2 * j)
            return (backward, out.shape, later), 0.0
        return (backward, None, later), float(out)

    def backward(self, j: int, pending):
        """Micro-batch j's backward on this stage (split: its input's gradient only); its weights' kept for W."""
        backward, shape, later = pending
        g = None if self.p == self.K - 1 else self._recv(shape, self.p + 1, 2 * j + 1, f"micro-batch {j}'s gradient")
        t0 = time.perf_counter()
        self.reducer.before_backward(j)
        g_in = backward(g)
        self.events.append(("B", j, t0, time.perf_counter()))
        if self.p > 0:
            self._send(g_in, self.p - 1, 2 * j + 1)
        return later

    def weights(self, j: int, later: Later) -> None:
        """Micro-batch j's W pass: its weight gradients computed and landed (the reducer told it is j's)."""
        t0 = time.perf_counter()
        self.reducer.before_backward(j)
        later.land(self.model.seam, not self.reducer.accumulates)
        self.events.append(("W", j, t0, time.perf_counter()))

    def forward_backward(self, batches: list, step: int) -> list[float]:
        """Collective over the pipeline group. Every micro-batch's loss (0 except on the last stage)."""
        m, t0 = len(batches), time.perf_counter()
        self.reducer.start(m)
        self.model.begin(step)
        self.model.seam.step(True)
        if self.tie is not None:
            self.tie.refresh()
        if self.reducer.accumulates:   # ZeRO-1: the micro-batches' gradients add up in the buffer
            self.model.grads.fill(0.0)
        self.events, pending, losses = [], {}, [0.0] * m
        for kind, j in order(self.schedule, self.p, self.K, m):
            if kind == "F":
                pending[j], losses[j] = self.forward(j, *batches[j])
            elif kind == "B" and self.schedule == "zb-h1":
                pending[j] = self.backward(j, pending[j])
            else:    # a joined backward, or zb-h1's W pass: micro-batch j's gradient is complete
                (self.weights if kind == "W" else self.backward)(j, pending.pop(j))
                self.hooks.gradients(step, j, self.model.grads)
                self.reducer.after_backward(j)
        self.model.seam.step(False)
        self.drain()
        if self.tie is not None:
            self.tie.drain()
        self.span = (t0, time.perf_counter())
        return losses

    def loss(self, x, y, scale: float) -> float:
        """Forward only through the pipeline: the last stage's scaled summed loss (0 on the others)."""
        if self.tie is not None:
            self.tie.refresh()
        out = self.model.evaluate(x, y, scale, start=self._received(x, EVAL_TAG, "held-out activations"))
        if self.p == self.K - 1:
            return float(out)
        self._send(out, self.p + 1, EVAL_TAG)
        self.drain()
        return 0.0
