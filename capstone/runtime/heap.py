"""The C heap of a training process: freed activations stay in it between steps.

glibc returns freed memory at the top of the heap to the OS once more than M_TRIM_THRESHOLD is
free, and serves blocks above M_MMAP_THRESHOLD with fresh mappings; either way the next step
page-faults the same activations back in (at the `large` preset a 256 MiB trim threshold cost 50k
faults and 13% of a step). A training step reaches the same peak every time, so never trim.
"""

import contextlib


def keep_freed_memory() -> None:
    """Never trim the heap, and keep blocks up to 256 MiB in it (no-op where glibc is not the libc)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, -1)         # M_TRIM_THRESHOLD: -1, never trim
        libc.mallopt(-3, 256 << 20)  # M_MMAP_THRESHOLD
