"""The seam between the model and the modes: where a parameter group's weights come from and its gradient goes
(docs/design.md, "Inside the step", model/seam.py)."""

from typing import Callable, Protocol

import numpy as np


class Weights(Protocol):
    params: np.ndarray          # what the optimizer updates: the flat buffer (ZeRO-3: this rank's shard)
    grads: np.ndarray | None    # the flat gradient buffer (None: each group's gradient is handed on)

    def weights(self, group: str, backward: bool) -> np.ndarray: ...
    def release(self, group: str) -> None: ...
    def grad_out(self, group: str, fresh: bool) -> np.ndarray: ...
    def landed(self, group: str, grad: np.ndarray, fresh: bool) -> None: ...
    def step(self, begins: bool) -> None: ...
    def whole(self) -> np.ndarray: ...
    def gathered_peak(self) -> int: ...     # bytes of gathered weights held at once, over the run
    def gathered_bound(self) -> int: ...    # its formula (capstone.observe.memory)


class MaskSource(Protocol):
    """The model's second input besides its weights, with --dropout: each micro-batch's masks."""

    def begin(self, step: int) -> None: ...
    def next(self, B: int): ...             # the next micro-batch's masks (capstone.model.dropout.Masks)


class TieSource(Protocol):
    """The model's third, with --tie-embeddings: each pass's tied wte."""

    def for_pass(self): ...                 # capstone.model.tied.Tie


def ignore(group: str, grad: np.ndarray) -> None:
    """An `on_landed` that does nothing (nobody reduces during the backward pass)."""


class Sinks:
    """Where gradients land: `sinks` (name -> flat array; None: handed on as made), then `on_landed(group, sink)`."""

    def __init__(self, sinks: dict | None, on_landed: Callable = ignore):
        self.sinks, self.on_landed = sinks, on_landed

    def grad_out(self, group: str, fresh: bool, like: int) -> np.ndarray:
        """The group's sink on a fresh pass (the gradient is written in place), else a new array."""
        if fresh and self.sinks is not None:
            return self.sinks[group]
        return np.empty(like, dtype=np.float32)

    def landed(self, group: str, grad: np.ndarray, fresh: bool) -> None:
        """Into the sink (a fresh pass: written over it; else added), then `on_landed`."""
        if self.sinks is None:
            self.on_landed(group, grad)
            return
        sink = self.sinks[group]
        if fresh and grad is not sink:
            np.copyto(sink, grad)
        elif not fresh:
            np.add(sink, grad, out=sink)
        self.on_landed(group, sink)


class Resident:
    """Weights held whole on this rank (`groups`: name -> flat array, views of `params`), gradients into `Sinks`."""

    def __init__(self, groups: dict, sinks: dict | None = None, on_landed: Callable = ignore, params=None, grads=None):
        self.groups, self.out, self.params, self.grads = groups, Sinks(sinks, on_landed), params, grads

    @classmethod
    def over(cls, layout, params: np.ndarray, grads: np.ndarray | None = None, on_landed: Callable = ignore):
        """The seam of flat buffers of `layout`: the parameters and (None: none) the gradients."""
        return cls(layout.groups(params), None if grads is None else layout.groups(grads), on_landed, params, grads)

    def weights(self, group: str, backward: bool = False) -> np.ndarray:
        return self.groups[group]

    def release(self, group: str) -> None:
        """Nothing to drop: the weights stay."""

    def grad_out(self, group: str, fresh: bool) -> np.ndarray:
        return self.out.grad_out(group, fresh, self.groups[group].size)

    def landed(self, group: str, grad: np.ndarray, fresh: bool) -> None:
        self.out.landed(group, grad, fresh)

    def step(self, begins: bool) -> None:
        """Nothing to hold or drop."""

    def whole(self) -> np.ndarray:
        """The flat parameter buffer (this rank's slice of the model under tensor parallelism)."""
        return self.params

    def gathered_peak(self) -> int:
        """Bytes of gathered weights held at once (and its bound): none, they are resident."""
        return 0

    gathered_bound = gathered_peak
