"""--precision bf16's exchange (capstone.parallel.bf16sum): bfloat16 pieces to their owners, summed there in float32.

Rank r sends 1 + r * 2**-7 (exact in bfloat16) plus 2**-9 (below bfloat16's half ulp at 1: narrowed away) in every
element. The owner's float32 sum of the narrowed pieces is exactly world + 2**-7 * world (world - 1) / 2: a sum in
bfloat16 rounds it (at 4 ranks 4 + 6 * 2**-7 needs 2**-6 steps), a sum before narrowing keeps the 2**-9s.
"""

import numpy as np

from capstone.model.precision import BF16, narrow, widen
from capstone.parallel.bf16sum import Pieces


def test_the_pieces_are_summed_in_float32_by_their_owners(world):
    w, r = world.size, world.rank
    counts = [3 + q for q in range(w)]                     # rank q owns counts[q] values of the range
    send = np.full(sum(counts), 1 + r * 2.0**-7 + 2.0**-9, dtype=np.float32)
    pieces = Pieces(world, send, counts)
    world.wait(pieces.request, "bf16 pieces")
    into = np.full(counts[r], 5.0, dtype=np.float32)
    pieces.sum_into(into)
    want = np.float32(w + 2.0**-7 * w * (w - 1) / 2)
    assert np.all(into == want), (into, want)
    pieces.sum_into(into, add=True)                         # a later micro-batch's: added
    assert np.all(into == 2 * want)
    assert pieces.bits.nbytes == 2 * send.size              # half a float32 reduce-scatter's bytes


def test_narrowing_rounds_to_nearest_even_and_keeps_nan_and_inf():
    """Every float32 of a few bit patterns against the float64 rounding of its value, the NaNs with a payload in the
    lower half (a carry would make them infinities) and the overflow to infinity."""
    patterns = np.arange(0, 1 << 32, 65537 * 3, dtype=np.uint64).astype(np.uint32)
    x = patterns.view(np.float32)
    got = widen(narrow(x))
    finite = np.isfinite(x)
    ulp = np.ldexp(1.0, np.frexp(x[finite].astype(np.float64))[1] - 8)    # bfloat16's ulp at each value
    ulp = np.maximum(ulp, 2.0**-133)                                        # subnormals: the smallest step
    err = np.abs(got[finite].astype(np.float64) - x[finite])
    assert np.all((err <= ulp / 2) | ~np.isfinite(got[finite]))
    tie = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=np.float32)
    assert widen(narrow(tie)).tolist() == [1.0, 1 + 2**-6, -1.0]          # ties to the even neighbour
    nan = np.array([0x7F800001, 0xFF800001, 0x7FC00000], dtype=np.uint32).view(np.float32)
    assert np.isnan(widen(narrow(nan))).all()
    assert widen(narrow(np.array([np.inf, -np.inf, 3.4e38], np.float32))).tolist() == [np.inf, -np.inf, np.inf]
    assert narrow(np.ones(3, np.float32)).dtype == BF16
