"""Reverse mode over named parameters, landing each gradient in a caller's buffer (public autograd API).

Each parameter enters the graph through `_tap(anchor, value, sink)`, an identity primitive whose
VJP adds the incoming gradient to `sink` (a view of the flat gradient buffer) and passes zero on
to the scalar `anchor`, the one input `autograd.make_vjp` differentiates. So the graph has one
root instead of a boxed dict (whose container VJPs cost more than the model at small sizes), and
gradients accumulate in place across micro-batches without a dict of copies.

The tap's VJP runs once per parameter per backward pass, right after that parameter's gradient is
complete (autograd sums a node's incoming gradients before calling its VJP), in reverse order of
use: the last layers first. `set_grad_hook` installs one callable that is called there with the
sink; capstone.buckets uses it to start the reduce-scatter of a bucket as soon as every parameter
in it is final, overlapping communication with the rest of the backward pass (as PyTorch DDP does).
"""

from __future__ import annotations

import numpy as np
from autograd import make_vjp
from autograd.extend import defvjp, primitive, vspace


_grad_hook = None   # called as _grad_hook(sink) after each tap's gradient has landed in its sink


def set_grad_hook(hook):
    """Install `hook(sink)` (None: none), called after every tap's VJP; returns the previous hook."""
    global _grad_hook
    previous, _grad_hook = _grad_hook, hook
    return previous


@primitive
def _tap(anchor, value, sink):
    """Forward: the parameter itself. Backward: sink += g."""
    return value


def _tap_vjp(ans, anchor, value, sink):
    def vjp(g):
        np.add(sink, g, out=sink)
        if _grad_hook is not None:
            _grad_hook(sink)
        return np.zeros((), dtype=sink.dtype)  # the anchor's share: nothing
    return vjp


defvjp(_tap, _tap_vjp, None, None)


def value_and_grad_into(fun, params: dict, sinks: dict, *args):
    """Evaluate fun(params, *args) and add d fun / d params[name] into sinks[name] for every name.
    Returns the value as a float. Parameters the function does not use leave their sink as it was."""
    def through_taps(anchor):
        return fun({name: _tap(anchor, a, sinks[name]) for name, a in params.items()}, *args)

    vjp, value = make_vjp(through_taps)(0.0)
    vjp(vspace(value).ones())
    return float(value)
