"""Reverse mode over named parameters, landing each gradient in a caller's buffer (public autograd API).

Each parameter enters the graph through `_tap(anchor, value, sink)`, an identity primitive whose
VJP adds the incoming gradient to `sink` (a view of the flat gradient buffer) and passes zero on
to the scalar `anchor`, the one input `autograd.make_vjp` differentiates. So the graph has one
root instead of a boxed dict (whose container VJPs cost more than the model at small sizes), and
gradients accumulate in place across micro-batches without a dict of copies. On the first
micro-batch (`fresh`) the sinks are overwritten instead, and a VJP that asks `grad_buffer` for the
array to write a parameter's gradient into gets the sink itself: the gradient lands in the flat
buffer with no zero-fill, temporary or add (a sink no tap reached is zeroed at the end). Since
this pass calls each VJP once, a VJP may also free its saved activations as it uses them
(`drop_saved`), which lowers the peak of the backward pass.

The tap's VJP runs once per parameter per backward pass, right after that parameter's gradient is
complete (autograd sums a node's incoming gradients before calling its VJP), in reverse order of
use: the last layers first. `set_grad_hook` installs one callable that is called there with the
sink; capstone.parallel.buckets uses it to start the reduce-scatter of a bucket as soon as every parameter
in it is final, overlapping communication with the rest of the backward pass (as PyTorch DDP does).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from autograd import make_vjp
from autograd.extend import defvjp, primitive, vspace

_grad_hook = None   # called as _grad_hook(name, sink) after each tap's gradient has landed in its sink


@dataclass
class _Landing:
    """The sinks of the backward pass running now (value_and_grad_into's)."""

    once: bool = False                                # each VJP runs once: drop_saved may free
    fresh: bool = False                               # the sinks are overwritten, not added to
    by_param: dict = field(default_factory=dict)      # id(parameter array) -> its sink, until a VJP claims it
    untouched: dict = field(default_factory=dict)     # id(sink) -> sink, until its tap's VJP has run


_landing = _Landing()


def grad_buffer(w: np.ndarray, dtype) -> np.ndarray:
    """The array a VJP should write the gradient of parameter array `w` into and return: in a fresh
    backward pass, w's sink itself (once; the tap then has nothing to add), else a new array."""
    sink = _landing.by_param.pop(id(w), None)
    if sink is not None and sink.dtype == dtype and sink.shape == w.shape:
        return sink
    return np.empty(w.shape, dtype)


def drop_saved(saved: list) -> bool:
    """Empty a VJP's list of saved activations in value_and_grad_into's backward pass, which calls
    each VJP once: the VJP then holds the only references and can free (or overwrite) each
    activation once used. Any other pass (autograd.grad, a VJP called twice) keeps them. Returns
    whether the VJP now owns them."""
    if _landing.once:
        saved.clear()
    return _landing.once


@contextmanager
def training_pass():
    """A backward pass that calls each VJP once, outside value_and_grad_into (ZeRO-3's): VJPs own
    their saved activations (`drop_saved`)."""
    _landing.once = True
    try:
        yield
    finally:
        _landing.once = False


def set_grad_hook(hook):
    """Install `hook(name, sink)` (None: none), called after every tap's VJP with the parameter's
    name and its sink (without sinks: its gradient, to keep or send); returns the previous hook."""
    global _grad_hook
    previous, _grad_hook = _grad_hook, hook
    return previous


@primitive
def _tap(anchor, value, sink, name):
    """Forward: the parameter itself. Backward: sink += g (in a fresh pass: sink = g; no sink: g
    goes to the hook as it is)."""
    return value


def _tap_vjp(ans, anchor, value, sink, name):
    def vjp(g):
        if sink is None:
            _grad_hook(name, g)
            return np.zeros((), dtype=g.dtype)
        if _landing.fresh and _landing.untouched.pop(id(sink), None) is not None:
            if g is not sink:               # else a VJP wrote it there (grad_buffer)
                np.copyto(sink, g)
        else:
            np.add(sink, g, out=sink)
        if _grad_hook is not None:
            _grad_hook(name, sink)
        return np.zeros((), dtype=sink.dtype)  # the anchor's share: nothing
    return vjp


defvjp(_tap, _tap_vjp, None, None, None)


def value_and_grad_into(fun, params: dict, sinks: dict, *args, fresh: bool = False, on_forward=None):
    """Evaluate fun(params, *args) and add d fun / d params[name] into sinks[name] for every name
    (`fresh`: write it there, whatever the sinks held; the gradient of a parameter the function does
    not use is then zero, else its sink is left as it was). `sinks` None: each gradient goes to the
    grad hook as the backward pass makes it, nothing is kept (ZeRO-2). Returns the value as a float.
    `on_forward()`, if given, is called between the forward and the backward pass (benchmarks)."""
    def through_taps(anchor):
        return fun({name: _tap(anchor, a, None if sinks is None else sinks[name], name)
                    for name, a in params.items()}, *args)

    vjp, value = make_vjp(through_taps)(0.0)
    if on_forward is not None:
        on_forward()
    if fresh and sinks is not None:
        _landing.by_param = {id(params[name]): sink for name, sink in sinks.items()}
        _landing.untouched = {id(sink): sink for sink in sinks.values()}
    _landing.fresh, _landing.once = fresh, True
    try:
        vjp(vspace(value).ones())
    finally:
        untouched, _landing.untouched, _landing.by_param = _landing.untouched, {}, {}
        _landing.fresh, _landing.once = False, False
    for sink in untouched.values() if fresh else ():
        sink.fill(0.0)
    return float(value)
