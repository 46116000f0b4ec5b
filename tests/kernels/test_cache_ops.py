"""Triton reshape_and_cache (run by the Triton interpreter) against the torch reference."""
from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cache_ops import reshape_and_cache, reshape_and_cache_ref


def random_slots(num_tokens: int, num_slots: int, num_padding: int) -> torch.Tensor:
    """Distinct shuffled slots, with `num_padding` of them replaced by -1 (padding tokens)."""
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[torch.randperm(num_tokens)[:num_padding]] = -1
    return slots


# (num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, cache_dtype, num_padding)
CASES = [
    (1, 1, 64, 16, 4, torch.float32, torch.float32, 0),
    (37, 2, 64, 16, 8, torch.float32, torch.float32, 5),
    (20, 3, 128, 32, 3, torch.float16, torch.float16, 0),
    (16, 8, 128, 32, 2, torch.bfloat16, torch.bfloat16, 3),
    (9, 2, 80, 16, 2, torch.float32, torch.bfloat16, 2),  # non-power-of-2 dim, casting store
]


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size,num_blocks,dtype,cache_dtype,num_padding", CASES)
def test_matches_reference(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype,
                           cache_dtype, num_padding):
    torch.manual_seed(0)
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)
    ref_key_cache, ref_value_cache = key_cache.clone(), value_cache.clone()
    slots = random_slots(num_tokens, num_blocks * block_size, num_padding)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    reshape_and_cache_ref(key, value, ref_key_cache, ref_value_cache, slots)
    assert_same_cache(key_cache, ref_key_cache, exact=dtype == cache_dtype)
    assert_same_cache(value_cache, ref_value_cache, exact=dtype == cache_dtype)


def assert_same_cache(cache: torch.Tensor, ref: torch.Tensor, exact: bool) -> None:
    if exact:  # a plain copy
        assert torch.equal(cache, ref)
    else:  # the interpreter rounds fp32 -> bf16 toward zero, torch to nearest: 1 ulp apart
        torch.testing.assert_close(cache.float(), ref.float(), rtol=2**-7, atol=0)


def test_strided_views_of_fused_qkv_into_engine_layout():
    """The backend passes k/v as column slices of the fused QKV output and the caches as
    kv_cache[0] / kv_cache[1]."""
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, head_dim = 11, 4, 2, 16
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    key, value = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    kv_cache = torch.zeros(2, 3, 16, num_kv_heads, head_dim)
    ref_cache = kv_cache.clone()
    slots = random_slots(num_tokens, 48, 1)
    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots)
    reshape_and_cache_ref(key, value, ref_cache[0], ref_cache[1], slots)
    assert torch.equal(kv_cache, ref_cache)


def test_slots_past_int32_offsets_with_int32_slot_mapping(huge_kv_caches):
    """slot * row stride passes 2**32 here; the kernel widens slots to int64 whatever the
    mapping's dtype, so an int32 mapping must still land in the right place."""
    torch.manual_seed(0)
    key_cache, value_cache = huge_kv_caches
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    slots = torch.tensor([num_blocks * block_size - 1, -1, (num_blocks - 7) * block_size + 3,
                          (num_blocks - 2) * block_size], dtype=torch.int32)
    key = torch.randn(4, num_kv_heads, head_dim).half()
    value = torch.randn(4, num_kv_heads, head_dim).half()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(key_cache[slot // block_size, slot % block_size], key[token])
            assert torch.equal(value_cache[slot // block_size, slot % block_size], value[token])
    # Where offsets wrapped to if they were int32: untouched.
    assert not key_cache[:16].any() and not value_cache[:16].any()
