"""Transparent huge pages for the KV cache on CPU.

Decode attention reads each sequence's blocks from scattered places in a cache of hundreds of
MiB: with 4 KiB pages nearly every block it moves to costs a TLB miss and a page walk, which the
kernel's prefetches wait on too. Linux's default THP mode is `madvise`: only ranges that ask get
2 MiB pages. So the cache asks (madvise MADV_HUGEPAGE) before its first touch, and the zeroing
that follows faults it in as huge pages. A hint only: where the kernel lacks THP or refuses, the
cache is the same memory with small pages, and the results are the same either way.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h

logger = logging.getLogger(__name__)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Asks for huge pages over the whole 2 MiB pages inside `tensor`'s memory (a CPU tensor not
    yet touched, for the advice to take effect at its first touch). Returns the bytes advised: 0
    off Linux, for tensors smaller than a huge page, or when the kernel refused."""
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return 0
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) on the KV cache failed: errno %d", ctypes.get_errno())
        return 0
    return last - first


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, advised onto huge pages before it is zeroed."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()
