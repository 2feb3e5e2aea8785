"""MiniGPT's layers one by one, as autograd primitives over the kernels of `capstone.model.kernels`.

The model runs the fused blocks (`capstone.model.blocks`), which compose the same forward and
backward functions; these single-layer primitives are what the sampler's KV-cache forward and the
tests (each hand-written VJP against finite differences) compose.
"""

from capstone.model.kernels import (
    _add,
    _attention_bwd,
    _attention_fwd,
    _embed_bwd,
    _embed_fwd,
    _gelu_fwd,
    _gelu_grad,
    _linear_fwd,
    _ln_bwd,
    _ln_fwd,
    _mm,
    _xent_fwd,
    _xent_grad_inplace,
    define,
)

embed = define("embed", _embed_fwd, _embed_bwd)


layer_norm = define("layer_norm", _ln_fwd, _ln_bwd)


def _linear_grads(g, argnums, x, w):
    """{0: dx, 1: dw, 2: db} of y = x @ w + b for output gradient g (N, Cout)."""
    rules = {0: lambda: _mm(g, w.T), 1: lambda: _mm(x.T, g), 2: lambda: _add(g, axis=0)}
    return {i: rules[i]() for i in argnums}


linear = define("linear", _linear_fwd, lambda g, _, argnums, x, w, b: _linear_grads(g, argnums, x, w))


gelu = define("gelu", _gelu_fwd, lambda g, tp, argnums, u: {0: _gelu_grad(g, u, tp)})


def _linear_gelu_fwd(x, w, b):
    """gelu(x @ w + b): x (N, Cin) -> (N, Cout); saves the pre-activation and its tanh (the blocks fuse it so)."""
    u, _ = _linear_fwd(x, w, b)
    y, t = _gelu_fwd(u)
    return y, (u, t)


linear_gelu = define("linear_gelu", _linear_gelu_fwd,
                     lambda g, saved, argnums, x, w, b: _linear_grads(_gelu_grad(g, *saved), argnums, x, w))


causal_attention = define("causal_attention", _attention_fwd, _attention_bwd)


cross_entropy_sum = define("cross_entropy_sum", _xent_fwd,
                           lambda g, probs, argnums, z, targets: {0: _xent_grad_inplace(probs.copy(), targets, g)})
