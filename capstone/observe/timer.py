"""The wall time of a step's phases, as torchtitan and llm.c keep timing out of the step's logic:

    timer = PhaseTimer()
    with timer("fwd_bwd"):
        ...
    timer.ms   # {"fwd_bwd": 12.3, ...}, milliseconds; timer.total_ms() since the timer was made
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.ms: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.ms[phase] = self.ms.get(phase, 0.0) + 1e3 * (time.perf_counter() - t)

    def total_ms(self) -> float:
        return 1e3 * (time.perf_counter() - self.t0)
