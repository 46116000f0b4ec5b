"""The kvstore process keeps the memory it frees for its next blocks (glibc's malloc).

Why: every block a put receives is a buffer of its own (transports/tcp/server.py) of about a MiB,
and glibc, left to itself, hands memory freed at the top of a heap back to the kernel
(trim) and maps large buffers afresh: the next put then pays a page fault and the
kernel zeroing each page before a byte lands. Measured here on a 47 MB put: 11,300 page
faults and about 40 ms of CPU, against none and about 21 ms with this. A store holds up
to its capacity anyway, so keeping freed memory up to that much costs nothing it would
not use (what Redis gets from jemalloc).

    M_MMAP_THRESHOLD 32 MiB  buffers below it come from the heap, reused once freed
                             (glibc's own dynamic threshold would move; setting trim stops that)
    M_TRIM_THRESHOLD         the capacity (at most 2 GiB, an int): free memory up to it stays
    M_TOP_PAD 64 MiB         a thread's heap (64 MiB each, one arena per connection thread)
                             is not unmapped as soon as it is empty, nor grown page by page

Only for `pdserve kvstore` (its main), never on import: a library must not change its
host's allocator. Without glibc (musl, macOS) it does nothing and says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TOP_PAD_BYTES = 64 << 20
_INT_MAX = (1 << 31) - 1


def keep_freed_memory(capacity_bytes: int) -> bool:
    """Sets the thresholds above; False where there is no glibc mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.info("no glibc mallopt here: freed block memory goes back to the system as its allocator decides")
        return False
    trim = min(max(capacity_bytes, MMAP_THRESHOLD_BYTES), _INT_MAX)
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, trim), (_M_TOP_PAD, TOP_PAD_BYTES))
    return all([bool(mallopt(option, value)) for option, value in settings])
