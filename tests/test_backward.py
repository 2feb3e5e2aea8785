"""The gradient taps (capstone.backward): a step's first micro-batch overwrites the flat gradient
buffer (the blocks write their gradients straight into it), later ones add to it, and a parameter
no VJP reached ends with a zero gradient, whatever the buffer held before; a training backward
pass frees each block's activations as it goes."""

import tracemalloc

import autograd
import autograd.numpy as anp
import numpy as np
import pytest

from capstone.config import ModelConfig
from capstone.model import backward, blocks, kernels
from capstone.model.backward import value_and_grad_into
from capstone.model.gpt import Model, loss_sum
from capstone.model.params import Layout, init_params

CFG = ModelConfig(vocab_size=13, seq_len=8, d_model=16, n_heads=2, n_layers=2)


def model():
    layout = Layout.for_model(CFG, 1)
    return Model(CFG, layout, init_params(layout, CFG, 5))


def batch(seed, B=3):
    x = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(B, CFG.seq_len))
    return x, np.roll(x, -1, axis=1)


def accumulated(m, batches, scale):
    """The gradient by the plain route: zeroed sinks, each micro-batch added into them."""
    grads = np.zeros_like(m.grads)
    loss = sum(value_and_grad_into(loss_sum, m.groups, m.layout.groups(grads), x, y, CFG, scale)
               for x, y in batches)
    return loss, grads


def test_first_micro_batch_overwrites_whatever_the_buffer_held():
    m = model()
    m.grads[:] = np.nan
    m.grads[::7] = 3.0
    loss = m.forward_backward([batch(0)], 0.1)
    want_loss, want = accumulated(m, [batch(0)], 0.1)
    assert loss == want_loss
    np.testing.assert_array_equal(m.grads, want)
    assert np.abs(want).max() > 0


def test_later_micro_batches_add_to_the_first():
    m = model()
    m.grads[:] = 9.0
    loss = m.forward_backward([batch(1), batch(2), batch(3)], 0.05)
    want_loss, want = accumulated(m, [batch(1), batch(2), batch(3)], 0.05)
    assert loss == want_loss
    np.testing.assert_array_equal(m.grads, want)


def test_fresh_pass_zeroes_a_parameter_the_function_does_not_use():
    m = model()
    m.grads[:] = 5.0
    x, y = batch(4)

    def skip_h1_tap(groups, *args):  # block h1 computed from the bare array: its tap is never reached
        return loss_sum({**groups, "h1": m.groups["h1"]}, *args)

    value_and_grad_into(skip_h1_tap, m.groups, m.grad_groups, x, y, CFG, 1.0, fresh=True)
    assert (m.grad_groups["h1"] == 0.0).all()
    assert np.abs(m.grad_groups["h0"]).max() > 0


def test_a_parameter_used_twice_gets_the_sum_of_both_uses():
    m = model()
    m.grads[:] = -1.0
    x, y = batch(7)

    def twice(groups, *args):  # h0 in its block and in a penalty: autograd sums the two gradients
        return loss_sum(groups, *args) + 0.5 * anp.sum(groups["h0"] * groups["h0"])

    value_and_grad_into(twice, m.groups, m.grad_groups, x, y, CFG, 1.0, fresh=True)
    want = np.zeros_like(m.grads)
    value_and_grad_into(twice, m.groups, m.layout.groups(want), x, y, CFG, 1.0)
    np.testing.assert_array_equal(m.grads, want)


@pytest.mark.parametrize("fresh", [True, False])
def test_every_group_gradient_is_written_in_the_buffer_only_in_a_fresh_pass(monkeypatch, fresh):
    m = model()
    into_buffer = []

    def recording(w, dtype):
        out = backward.grad_buffer(w, dtype)
        into_buffer.append(np.shares_memory(out, m.grads))
        return out

    monkeypatch.setattr(blocks, "grad_buffer", recording)
    value_and_grad_into(loss_sum, m.groups, m.grad_groups, *batch(6), CFG, 1.0, fresh=fresh)
    assert into_buffer == [fresh] * len(m.groups)


def test_a_training_backward_frees_the_mlp_activations_before_the_attention_backward(monkeypatch):
    """value_and_grad_into runs each VJP once, so a block frees its MLP's activations (h, the GELU's
    input and tanh) before its attention backward; a general autograd pass keeps them (pure VJPs)."""
    m = model()
    x, y = batch(8, B=8)
    traced, original = [], kernels._attention_bwd

    def recording(*args, **kwargs):
        traced.append(tracemalloc.get_traced_memory()[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "_attention_bwd", recording)
    tracemalloc.start()
    try:
        value_and_grad_into(loss_sum, m.groups, m.grad_groups, x, y, CFG, 1.0)
        dropping, first = traced[0], len(traced)
        autograd.grad(loss_sum)(m.groups, x, y, CFG, 1.0)
        keeping = traced[first]
    finally:
        tracemalloc.stop()
    mlp = 3 * x.size * 4 * CFG.d_model * 4
    assert dropping <= keeping - mlp, (dropping, keeping, mlp)
