"""MiniGPT's layers one by one, as autograd primitives over the kernels of `capstone.model.kernels`.

The model runs the fused blocks (`capstone.model.blocks`), which compose the same forward and
backward functions; these single-layer primitives are what the sampler's KV-cache forward and the
tests (each hand-written VJP against finite differences) compose.
"""

from capstone.model import kernels as K

embed = K.define("embed", K._embed_fwd, K._embed_bwd)


layer_norm = K.define("layer_norm", K._ln_fwd, K._ln_bwd)


def _linear_grads(g, argnums, x, w):
    """{0: dx, 1: dw, 2: db} of y = x @ w + b for output gradient g (N, Cout)."""
    rules = {0: lambda: K._mm(g, w.T), 1: lambda: K._mm(x.T, g), 2: lambda: K._add(g, axis=0)}
    return {i: rules[i]() for i in argnums}


linear = K.define("linear", K._linear_fwd, lambda g, _, argnums, x, w, b: _linear_grads(g, argnums, x, w))


gelu = K.define("gelu", K._gelu_fwd, lambda g, tp, argnums, u: {0: K._gelu_grad(g, u, tp)})


def _linear_gelu_fwd(x, w, b):
    """gelu(x @ w + b): x (N, Cin) -> (N, Cout); saves the pre-activation and its tanh (the blocks fuse it so)."""
    u, _ = K._linear_fwd(x, w, b)
    y, t = K._gelu_fwd(u)
    return y, (u, t)


linear_gelu = K.define("linear_gelu", _linear_gelu_fwd,
                       lambda g, saved, argnums, x, w, b: _linear_grads(K._gelu_grad(g, *saved), argnums, x, w))


causal_attention = K.define("causal_attention", K._attention_fwd, K._attention_bwd)


cross_entropy_sum = K.define("cross_entropy_sum", K._xent_fwd,
                             lambda g, probs, argnums, z, targets: {0: K._xent_grad_inplace(probs.copy(), targets, g)})
