"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import pytest
import torch

HUGE_BLOCK_SIZE, HUGE_NUM_KV_HEADS, HUGE_HEAD_DIM = 16, 1, 64


@pytest.fixture(scope="session")
def huge_kv_caches() -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 key/value caches interleaved per block in one storage of just over 2**32 elements
    (8 GiB of address space; pages never written are never committed, so this costs only the
    blocks a test touches). Blocks at the end sit past element 2**32: an offset computed in
    int32 wraps to a block near the start, still mapped, so the bug shows as wrong values
    rather than a crash."""
    block_numel = HUGE_BLOCK_SIZE * HUGE_NUM_KV_HEADS * HUGE_HEAD_DIM
    num_blocks = 2**32 // (2 * block_numel) + 16
    kv = torch.empty((num_blocks, 2, HUGE_BLOCK_SIZE, HUGE_NUM_KV_HEADS, HUGE_HEAD_DIM), dtype=torch.float16)
    kv[:16].zero_()  # where wrapped int32 offsets land: zeros, never the expected values
    return kv[:, 0], kv[:, 1]


@pytest.fixture
def far_block_tables(huge_kv_caches) -> torch.Tensor:
    """Two sequences' block tables over the last blocks of the huge caches (past element
    2**32), those blocks filled with random values (seed 0)."""
    torch.manual_seed(0)
    key_cache, value_cache = huge_kv_caches
    num_blocks = key_cache.shape[0]
    block_tables = torch.tensor([[num_blocks - 1, num_blocks - 5, num_blocks - 3],
                                 [num_blocks - 2, num_blocks - 4, num_blocks - 6]], dtype=torch.int32)
    for block_id in block_tables.flatten().tolist():
        key_cache[block_id] = torch.randn(key_cache.shape[1:]).half()
        value_cache[block_id] = torch.randn(value_cache.shape[1:]).half()
    return block_tables
