"""glibc's malloc, told to keep the memory a CPU engine frees and allocates again every step.

A step's large temporaries (a batch's activations, logits: a few MiB to tens of MiB) are
above glibc's mmap threshold, so each is a fresh mmap, faulted in and zeroed page by page by
the kernel, then unmapped when freed; and freed heap memory above the trim threshold goes back
to the kernel too. Measured on the offline benchmark (64 requests, SmolLM2, 2 threads): 3.3
million page faults and 21 s of system time, against 0.49 million and 14 s with the
thresholds raised (docs/kernels.md). vLLM's CPU backend avoids the same cost by preloading tcmalloc.

Raised thresholds mean the process keeps its peak working set (a batch's worth) instead of
returning it between steps; the KV cache and the weights are allocated once either way.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys

M_TRIM_THRESHOLD = -1   # malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20     # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); above it, mmap stays
TRIM_THRESHOLD = (1 << 31) - 1    # mallopt takes an int: keep up to 2 GiB of freed heap

logger = logging.getLogger(__name__)


@functools.cache
def keep_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds, once per process; False where the C library is
    not glibc (nothing to tune) or refused."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: a different allocator
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        logger.warning("mallopt refused the mmap/trim thresholds; every step's temporaries are faulted in anew")
    return ok
