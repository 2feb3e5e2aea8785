"""Context parallelism's causal ring attention under mpirun (-n 4: rings of 2 and 4; -n 3: a ring of
3), real messages round the cp ring, against the whole-sequence kernel on one rank in float64; with
attention dropout, against the whole kernel with the same (T, T) mask (capstone.model.dropout)."""

import numpy as np
import pytest
from mpi4py import MPI

from capstone.collective.comm import Comm
from capstone.model import dropout
from capstone.model import kernels as K
from capstone.model import ring

WORLD, RANK = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
B, H, D = 2, 2, 4


def _ring(k: int) -> ring.Ring:
    """A ring of the k consecutive world ranks of this rank."""
    return ring.Ring(Comm(MPI.COMM_WORLD).split(RANK // k, RANK % k, "test ring"))


def _rows(r: ring.Ring, a: np.ndarray, t: int) -> np.ndarray:
    """This rank's rows of a (B*T, ...) array of whole sequences."""
    return r.part(a.reshape(B, t, -1)).reshape(-1, a.shape[-1])


def _rel(r: ring.Ring, mine: np.ndarray, whole_rows: np.ndarray) -> float:
    """||a - b|| / ||b|| over the ring's ranks (each holding its rows of both)."""
    diff, ref = r.cp.sum([float(np.sum((mine - whole_rows) ** 2)), float(np.sum(whole_rows ** 2))], "test")
    return (diff / ref) ** 0.5


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 3, 100])   # 100: chunks of two query tiles (ring.TILE 64)
def test_ring_attention_equals_whole_attention(k, n):
    if WORLD % k:
        pytest.skip(f"a ring of {k} needs a multiple of {k} ranks")
    r, t = _ring(k), 2 * k * n
    rng = np.random.default_rng(11 + n)                 # the same whole sequences on every rank
    qkv, g = rng.standard_normal((B * t, 3 * H * D)), rng.standard_normal((B * t, H * D))
    y_ref, saved = K._attention_fwd(qkv, t, H)
    gqkv_ref = K._attention_bwd(g, saved, (0,), qkv, t, H)[0]
    mine = _rows(r, qkv, t)
    y, saved = r.attention(mine, 2 * n, H)
    gqkv = r.attention_back(_rows(r, g, t), saved, (0,), mine, 2 * n, H)[0]
    assert _rel(r, y, _rows(r, y_ref, t)) <= 1e-6
    want = _rows(r, gqkv_ref, t).reshape(-1, 3, H * D)
    for i, name in enumerate("qkv"):
        assert _rel(r, gqkv.reshape(-1, 3, H * D)[:, i], want[:, i]) <= 1e-6, f"d{name}"
    counts = np.empty(k, dtype=np.int64)
    r.cp.Allgather(counts, "test", send=np.array([r.computed], dtype=np.int64))
    assert counts.tolist() == [2 * k + 1] * k == ring.blocks(k)        # balanced: every rank the same


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("n", [3, 70])   # 70: chunks of two query tiles (ring.TILE 64)
def test_ring_attention_with_dropout_equals_whole_attention_with_the_same_mask(k, n):
    """Each block's probabilities masked at their global (query, key) positions, the sum of
    exponentials undropped: the whole kernel's dropout(softmax(s)) v, forward and dq, dk, dv."""
    if WORLD % k:
        pytest.skip(f"a ring of {k} needs a multiple of {k} ranks")
    r, t, layer = _ring(k), 2 * k * n, 1
    rng = np.random.default_rng(5 + n)
    qkv, g = rng.standard_normal((B * t, 3 * H * D)), rng.standard_normal((B * t, H * D))
    keep = dropout.Masks(0.3, 7, 2, np.arange(3, 3 + B)).attention(layer, t, H, 0)
    assert 0.2 < (keep == 0).mean() < 0.4
    y_ref, saved = dropout.attention_forward(qkv, t, H, keep)
    gqkv_ref = dropout.attention_backward(g, saved, qkv, t, H)
    masks = dropout.Masks(0.3, 7, 2, np.arange(3, 3 + B), r)
    mine = _rows(r, qkv, t)
    y, saved = r.attention(mine, 2 * n, H, masks.drop(layer, 2 * n, H, 0))
    gqkv = r.attention_back(_rows(r, g, t), saved, (0,), mine, 2 * n, H)[0]
    assert _rel(r, y, _rows(r, y_ref, t)) <= 1e-6
    assert _rel(r, r.attention(mine, 2 * n, H)[0], _rows(r, y_ref, t)) > 1e-2      # the mask is applied
    want = _rows(r, gqkv_ref, t).reshape(-1, 3, H * D)
    for i, name in enumerate("qkv"):
        assert _rel(r, gqkv.reshape(-1, 3, H * D)[:, i], want[:, i]) <= 1e-6, f"d{name}"


def test_naive_split_is_unbalanced():
    naive = ring.blocks(4, owned=lambda c, k: (2 * c, 2 * c + 1))
    assert naive == [4 * c + 3 for c in range(4)] and len(set(naive)) == 4
    assert ring.blocks(4) == [9] * 4


@pytest.mark.parametrize("k", [2, 4])
def test_positions_and_parts_cover_the_sequence(k):
    if WORLD % k:
        pytest.skip(f"a ring of {k} needs a multiple of {k} ranks")
    r, t = _ring(k), 8 * k
    seq = np.arange(2 * t).reshape(2, t)
    got = np.empty((k, 2 * 4), dtype=np.int64)
    r.cp.Allgather(got, "test", send=np.ascontiguousarray(r.part(seq)[0], dtype=np.int64))
    assert sorted(got.reshape(-1).tolist()) == list(range(t))                 # every position once
    assert (r.part(seq)[1] - t == r.positions(8)).all()                       # the real positions
