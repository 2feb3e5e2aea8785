"""Each invariant check fails when its condition is violated (and passes when it holds)."""

import numpy as np
import pytest

from capstone.observe import invariants
from capstone.observe import verdict
from capstone.model.fingerprint import fingerprint, word_sum


@pytest.mark.parametrize("n", [7, 8, 1001])
def test_every_single_bit_flip_changes_the_cheap_fingerprint(n):
    """(b) between evaluation steps compares the word sum: flipping any one of the 32 bits of any
    value (the odd last word included) changes it, and the strong digest too."""
    flat = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    norm, cheap = fingerprint(flat, strong=False)
    strong = fingerprint(flat)[1]
    assert len(cheap) == len(strong) == 16 and cheap != strong
    for i in sorted({0, 1, n // 2, n - 1}):
        for bit in range(32):  # exponent bits make infinities and NaNs: the norm says so, the digests too
            flipped = flat.copy()
            flipped.view(np.uint32)[i] ^= np.uint32(1 << bit)
            with np.errstate(invalid="ignore", over="ignore"):
                assert fingerprint(flipped, strong=False)[1] != cheap, (i, bit)
                assert fingerprint(flipped)[1] != strong
    assert word_sum(flat) == sum(int(w) for w in np.pad(flat.view(np.uint32), (0, n % 2)).view(np.uint64)) % 2**64
    assert fingerprint(flat.copy(), strong=False) == (norm, cheap)


def test_loss_monotone():
    ok = invariants.loss_monotone([(0, 4.0), (1, 3.5), (2, 3.2)], tol=1e-4)
    assert ok["ok"] and ok["max_increase"] < 0 and ok["steps"] == 2
    bad = invariants.loss_monotone([(0, 4.0), (1, 3.5), (2, 3.6)], tol=1e-4)
    assert not bad["ok"] and bad["at_step"] == 2 and abs(bad["max_increase"] - 0.1) < 1e-12
    assert invariants.loss_monotone([(0, 4.0), (1, 3.5), (2, 3.6)], tol=1e-4, rel=0.25)["ok"]
    flat = invariants.loss_monotone([(0, 4.0), (1, 4.0)], tol=1e-4)
    assert not flat["ok"], "it must also end below where it started"
    assert not invariants.loss_monotone([(0, 4.0)], tol=1e-4)["ok"], "no accepted update is no decrease"
    # after learning 2.0, a rise of 0.05 is within 5% of the progress; 0.2 is not
    converging = [(0, 4.0), (1, 2.0), (2, 2.05), (3, 1.9)]
    assert invariants.loss_monotone(converging, 1e-4, rel=0.05)["ok"]
    assert not invariants.loss_monotone(converging, 1e-4, rel=0.0)["ok"]
    jump = invariants.loss_monotone([(0, 4.0), (1, 2.0), (2, 2.2), (3, 1.9)], 1e-4, rel=0.05)
    assert not jump["ok"] and jump["at_step"] == 2 and abs(jump["allowed_there"] - (1e-4 + 0.1)) < 1e-12


def test_loss_monotone_settle_window_and_resumed_segments():
    early = [(0, 4.0), (1, 3.9), (2, 4.1), (3, 3.0)]  # an overshoot above the start at step 2
    assert not invariants.loss_monotone(early, 1e-4, 0.05)["ok"]
    assert invariants.loss_monotone(early, 1e-4, 0.05, settle_until=2)["ok"]
    assert not invariants.loss_monotone([(0, 4.0), (1, 3.9), (2, 4.3), (3, 3.0)], 1e-4, 0.05, settle_until=2)["ok"], \
        "more than 5% above the start is not settling"
    # A resumed segment starts from its own state; an old rise is not judged again
    seg = invariants.loss_monotone([(10, 2.0), (20, 1.9)], 1e-4, 0.05, start=4.0, best=1.95, fresh=False)
    assert seg["ok"] and seg["first"] == 2.0
    flat = invariants.loss_monotone([(10, 2.0), (20, 2.01)], 1e-4, 0.05, start=4.0, best=1.95, fresh=False)
    assert flat["ok"], "a resumed segment near convergence may be flat (within the wiggle)"
    up = invariants.loss_monotone([(10, 2.0), (20, 2.5)], 1e-4, 0.05, start=4.0, best=1.95, fresh=False)
    assert not up["ok"] and up["at_step"] == 20


def test_params_identical():
    assert invariants.params_identical([], 20)["ok"]
    assert not invariants.params_identical([{"step": 3}], 20)["ok"]
    assert not invariants.params_identical([], 0)["ok"]            # steps ran, none compared
    assert not invariants.params_identical([], 0, steps_run=3)["ok"]
    stopped = invariants.params_identical([], 0, steps_run=0)        # stopped before its first step
    assert stopped["ok"] and not stopped["judged"]


def test_optimizer_memory():
    P, N = 30145, 4
    padded = 30148
    assert invariants.optimizer_memory([12 * padded // N] * N, P, padded)["ok"]
    assert not invariants.optimizer_memory([12 * padded] * N, P, padded)["ok"], "unsharded state must fail"
    assert not invariants.optimizer_memory([12 * padded // N] * 3 + [12 * padded // N + 4], P, padded)["ok"]
    # too few bytes fail as well: a rank that holds less than its shard (m or v missing, a short shard)
    too_few = invariants.optimizer_memory([12 * padded // N] * 3 + [8 * padded // N], P, padded)
    assert not too_few["ok"] and too_few["max_deviation_bytes"] == 4 * padded // N
    assert not invariants.optimizer_memory([12 * padded // N - 4] * N, P, padded)["ok"]
    # stage 0 replicates the state: 12 * padded on every rank, and a shard is then too little
    assert invariants.optimizer_memory([12 * padded] * N, P, padded, N, replicated=True)["ok"]
    assert not invariants.optimizer_memory([12 * padded // N] * N, P, padded, N, replicated=True)["ok"]
    assert not invariants.optimizer_memory([12 * (P + N)] * N, P, P + N, N, replicated=True)["ok"], "padding >= N"


def test_resume_bytes_and_failure_lines():
    assert not invariants.resume_bytes(None)["ok"]
    d = invariants.resume_bytes({"ok": False, "path": "x.h5", "mismatched_bytes": 7, "errors": []})
    results = {"a_loss_monotone": invariants.loss_monotone([(0, 1.0), (1, 0.5)], 1e-4),
               "b_params_identical": invariants.params_identical([], 2),
               "c_memory": invariants.optimizer_memory([48], 4, 4), "d_resume_bytes": d}
    lines = verdict.failures(results)
    assert len(lines) == 1 and lines[0].startswith("(d)") and "7 bytes differ" in lines[0]
