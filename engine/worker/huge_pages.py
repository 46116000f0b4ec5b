"""Transparent huge pages for the KV cache on CPU.

Decode attention reads each sequence's blocks from scattered places in a cache of hundreds of
MiB: with 4 KiB pages nearly every block it moves to costs a TLB miss and a page walk, which the
kernel's prefetches wait on too. Linux's default THP mode is `madvise`: only ranges that ask get
2 MiB pages. So the cache is a private anonymous mapping of its own (never memory malloc has
handed out and taken back, which would already sit on small pages) that asks (MADV_HUGEPAGE)
before its first touch. A hint only: where the kernel lacks THP or refuses, the cache is the
same zeroed memory on small pages, and the results are the same either way.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, in a mapping advised onto huge pages and touched
    (committed) here rather than at its first use in a step."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):  # small, or not Linux
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: small pages, as torch.zeros would give
        pass
    # the tensor holds a reference to the mapping, which lives as long as it does
    return torch.frombuffer(mapping, dtype=dtype).view(shape).zero_()
