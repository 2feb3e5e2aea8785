"""The one backward driver over the seam (capstone.model.backward, capstone.model.seam): a step's
first micro-batch overwrites the flat gradient buffer (the blocks write their gradients straight
into it), later ones add to it; the seam hears of each group once per micro-batch, head first;
a seam without a buffer (ZeRO-2's) is handed the same gradients; a training backward pass frees
each block's activations as it goes."""

import tracemalloc

import numpy as np
import pytest

from capstone.config import ModelConfig
from capstone.model import blocks, kernels
from capstone.model.gpt import Model, loss_and_grad
from capstone.model.params import Layout, init_params
from capstone.model.seam import Resident

CFG = ModelConfig(vocab_size=13, seq_len=8, d_model=16, n_heads=2, n_layers=2)
LAYOUT = Layout.for_model(CFG, 1)


def model(on_landed=None, grads=True):
    params = init_params(LAYOUT, CFG, 5)
    seam = Resident.over(LAYOUT, params, LAYOUT.zeros() if grads else None, on_landed or (lambda g, a: None))
    return Model(CFG, LAYOUT, seam)


def batch(seed, B=3):
    x = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(B, CFG.seq_len))
    return x, np.roll(x, -1, axis=1)


def accumulated(m, batches, scale):
    """The gradient by the plain route: each micro-batch's own gradient, added up in order."""
    loss, grads = 0.0, None
    for x, y in batches:
        value, g = loss_and_grad(LAYOUT, m.params, x, y, CFG, scale)
        loss, grads = loss + value, g if grads is None else grads + g
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


def test_the_seam_hears_of_each_group_once_per_micro_batch_head_first():
    heard = []
    m = model(lambda group, sink: heard.append((group, np.shares_memory(sink, m.grads))))
    m.forward_backward([batch(1), batch(2)], 0.05)
    once = [("head", True), ("h1", True), ("h0", True), ("embed", True)]
    assert heard == once + once


def test_a_seam_without_a_buffer_is_handed_the_same_gradients():
    handed = {}
    kept, alone = model(), model(lambda group, g: handed.setdefault(group, g.copy()), grads=False)
    assert alone.grads is None
    assert kept.micro_batch(*batch(4), 0.1, fresh=True) == alone.micro_batch(*batch(4), 0.1, fresh=True)
    for group, sink in LAYOUT.groups(kept.grads).items():
        np.testing.assert_array_equal(handed[group], sink, err_msg=group)


@pytest.mark.parametrize("fresh", [True, False])
def test_every_group_gradient_is_written_in_the_buffer_only_in_a_fresh_pass(fresh):
    m = model()
    into_buffer, grad_out = [], m.seam.grad_out

    def recording(group, fresh_):
        out = grad_out(group, fresh_)
        into_buffer.append(np.shares_memory(out, m.grads))
        return out

    m.seam.grad_out = recording
    m.micro_batch(*batch(6), 1.0, fresh=fresh)
    assert into_buffer == [fresh] * len(LAYOUT.group_ranges())


def test_a_training_backward_frees_the_mlp_activations_before_the_attention_backward(monkeypatch):
    """The driver runs each VJP once, so a block frees its MLP's activations (h, the GELU's input
    and tanh) before its attention backward; a backward that keeps them (free=False) holds more."""
    m = model()
    x, y = batch(8, B=8)
    traced, original, block_backward = [], blocks.WHOLE.attention_back, blocks.block_backward

    def recording(*args, **kwargs):
        traced.append(tracemalloc.get_traced_memory()[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(blocks.Alone, "attention_back", staticmethod(recording))
    tracemalloc.start()
    try:
        m.micro_batch(x, y, 1.0, fresh=True)
        dropping, first = traced[0], len(traced)
        monkeypatch.setattr(blocks, "block_backward", lambda *a, free, **kw: block_backward(*a, free=False, **kw))
        m.micro_batch(x, y, 1.0, fresh=True)
        keeping = traced[first]
    finally:
        tracemalloc.stop()
    mlp = 3 * x.size * 4 * CFG.d_model * 4
    assert dropping <= keeping - mlp, (dropping, keeping, mlp)
