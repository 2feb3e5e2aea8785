"""MiniGPT in NumPy + autograd, float32 arithmetic (pre-LN GPT-2 blocks, GPT-2's dropout and tied head).

Activations are 2-D (B*T, C). The embedding, L blocks and the head with the loss (capstone.model.blocks) are
autograd nodes over flat parameter groups, run by the one driver (capstone.model.backward). `Model` is this rank's
part, whatever the modes: its groups (all, or a pipeline stage's), tensor-parallel group (`blocks.ALONE`: none),
seam (capstone.model.seam: where weights come from and gradients go) and option sources (MaskSource, TieSource).
"""

import numpy as np

from capstone.config import ModelConfig
from capstone.model.backward import Pass, block, differentiate, embedding, head_loss
from capstone.model.blocks import ALONE, WHOLE, head_logits
from capstone.model.params import Layout, group_shapes
from capstone.model.seam import MaskSource, Resident, TieSource, Weights


def hidden(ps: Pass, cfg: ModelConfig, names, start, idx):
    """Hidden states (B*T, C) after the embedding and blocks of `names` for ids idx (B, T), or from `start`."""
    shapes, H = group_shapes(cfg, ps.tp.size), cfg.n_heads // ps.tp.size
    x = embedding(start, ps, idx, shapes["embed"]) if "embed" in names else start
    for name in (g for g in names if g not in ("embed", "head")):
        x = block(x, ps, name, idx.shape[1], H, shapes[name])
    return x


def run_layers(ps: Pass, cfg: ModelConfig, names, start, idx, targets, scale):
    """Groups `names` of the model: scale * (summed cross-entropy against targets), or (no head) its hidden states."""
    h, shapes = hidden(ps, cfg, names, start, idx), group_shapes(cfg, ps.tp.size)
    return h if "head" not in names else head_loss(h, ps, targets.reshape(-1), shapes["head"], scale)


def tied_source(cfg: ModelConfig, tp=ALONE):
    """The tie source of a model on one rank (None: an untied head)."""
    if not cfg.tie_embeddings:
        return None
    from capstone.model import tied
    return tied.Tied(group_shapes(cfg, tp.size)["embed"][0])


def _forward_only(groups: dict, cfg: ModelConfig, tp) -> Pass:
    """A pass that keeps nothing over `groups` held whole (capstone.model.seam.Resident), with a tied head's tie."""
    tie = tied_source(cfg, tp)
    return Pass(Resident(groups), tp, train=False, tie=None if tie is None else tie.for_pass())


def logits(groups: dict, idx, cfg: ModelConfig, tp=ALONE):
    """Next-token logits (B*T, V) for token ids idx (B, T), forward only."""
    ps = _forward_only(groups, cfg, tp)
    x, wte = hidden(ps, cfg, tuple(groups), 0.0, idx), None if ps.tie is None else ps.tie.wte(ps.seam)
    return head_logits(x, groups["head"], group_shapes(cfg, tp.size)["head"], wte)[0]


def loss_sum(groups: dict, idx, targets, cfg: ModelConfig, scale=1.0, tp=ALONE) -> float:
    """scale * (sum over the B*T positions of the softmax cross-entropy), forward only."""
    return float(run_layers(_forward_only(groups, cfg, tp), cfg, tuple(groups), 0.0, idx, targets, scale))


def loss_and_grad(layout: Layout, flat: np.ndarray, idx, targets, cfg: ModelConfig, scale: float, tp=ALONE):
    """(loss value, gradient as a fresh flat buffer of `layout`) at parameters `flat`."""
    grads = np.zeros_like(flat)
    model = Model(cfg, layout, Resident.over(layout, flat, grads), tp)
    return model.micro_batch(idx, targets, scale, fresh=True), grads


class Model:
    """This rank's part of MiniGPT: the groups of `layout` (in order) over `seam` (see the module)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, seam: Weights, tp=ALONE, recompute: bool = False, cp=WHOLE,
                 masks: MaskSource | None = None, tie: TieSource | None = None, prec=None):
        self.cfg, self.layout, self.seam, self.tp, self.recompute, self.cp = cfg, layout, seam, tp, recompute, cp
        self.prec, self.masks = prec, masks      # bf16's (capstone.model.precision; None: fp32), dropout's (None: none)
        self.tie = tied_source(cfg, tp) if tie is None else tie    # None: an untied head
        self.names = tuple(layout.group_ranges())

    @classmethod
    def over(cls, cfg: ModelConfig, layout: Layout, params: np.ndarray, tp=ALONE, recompute: bool = False):
        """The model over its own flat buffers: `params` and a new gradient buffer (one rank's run)."""
        return cls(cfg, layout, Resident.over(layout, params, layout.zeros()), tp, recompute)

    @property
    def params(self) -> np.ndarray:
        """What the optimizer updates: the flat parameter buffer (ZeRO-3: this rank's shard)."""
        return self.seam.params

    @property
    def grads(self) -> np.ndarray | None:
        """The flat gradient buffer (None: ZeRO-2/3 hand each group's gradient on)."""
        return self.seam.grads

    def begin(self, step: int) -> None:
        """The step's micro-batches begin (their dropout masks are the step's)."""
        if self.masks is not None:
            self.masks.begin(step)

    def _pass(self, train: bool, fresh: bool = False, B: int = 0, later=None) -> Pass:
        masks = self.masks.next(B) if train and self.masks is not None else None
        tie = None if self.tie is None else self.tie.for_pass()
        return Pass(self.seam, self.tp, fresh, self.recompute, train, self.cp, masks, tie, later, self.prec)

    def forward(self, x, y, scale: float, start=0.0, fresh: bool = False, later=None):
        """(output, backward): this part's scaled summed loss (without the head: its hidden states) and the function
        that runs its backward pass (`differentiate`). `start`: the previous stage's activations (no embedding);
        `later`: the backward is split, its weight gradients kept there (capstone.parallel.pipeline.Later)."""
        ps = self._pass(True, fresh, x.shape[0], later)
        return differentiate(lambda s: run_layers(ps, self.cfg, self.names, s, x, y, scale), start)

    def micro_batch(self, x, y, scale: float, fresh: bool) -> float:
        """Gradient of scale * (summed loss of one micro-batch) through the seam (`fresh`: overwriting); its loss."""
        loss, backward = self.forward(x, y, scale, fresh=fresh)
        backward()
        return float(loss)

    def forward_backward(self, batches, scale: float) -> float:
        """Gradient of scale * (summed loss over every (x, y) in `batches`) into `grads`; returns that loss."""
        return sum(self.micro_batch(x, y, scale, fresh=j == 0) for j, (x, y) in enumerate(batches))

    def evaluate(self, x, y, scale: float, start=0.0):
        """Forward only, nothing kept: the scaled summed loss (without the head: the hidden states)."""
        return run_layers(self._pass(False), self.cfg, self.names, start, x, y, scale)

    def loss(self, x, y, scale: float) -> float:
        """scale * summed loss of one batch, forward only (the whole model)."""
        return float(self.evaluate(x, y, scale))

    def whole(self) -> np.ndarray:
        """Collective at ZeRO-3: the flat parameter buffer (this rank's slice under tp)."""
        return self.seam.whole()
