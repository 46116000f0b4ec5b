"""Writing a step's new K/V into their cache slots."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim]; slot = block_id * block_size + offset.
    A negative slot marks a padding token and is skipped."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


@triton.jit
def _reshape_and_cache_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cb, stride_cs, stride_ch,
                              block_size, num_kv_heads,
                              HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """One program per token: copies its [num_kv_heads, head_dim] K and V rows to their slot."""
    token = tl.program_id(0).to(tl.int64)
    # Loaded as int64 whatever the mapping's dtype: slot * stride overflows int32 on big caches.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + heads * stride_ch + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of `reshape_and_cache_ref`, same arguments and semantics.
    key/value may be strided views (e.g. slices of a fused QKV output) if the last dim is contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == value.stride(-1) == 1, "key/value: last dim must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1, \
        "key_cache/value_cache: same layout, last dim contiguous"
    heads_pad, dim_pad = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key_cache.shape[1], num_kv_heads, HEADS_PAD=heads_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        num_warps=_num_warps(heads_pad * dim_pad))


def _num_warps(tile_numel: int) -> int:
    """At least 8 elements per thread (16 bytes in 16-bit dtypes): full-width vector accesses."""
    return max(1, min(8, tile_numel // (8 * 32)))
