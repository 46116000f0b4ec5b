"""Sizing and allocating the paged KV cache: one preallocated pool per layer."""
from __future__ import annotations

import torch

from engine.config import CacheConfig, ModelArchConfig


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def num_kv_blocks(cache: CacheConfig, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> int:
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    if cache.kv_cache_memory_bytes is not None:
        budget, field = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    else:
        budget = int(cache.kv_cache_memory_fraction * available_memory(device))
        field = "kv_cache_memory_fraction"
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"{field}: a budget of {budget} bytes holds no KV block "
                         f"(one block of {cache.block_size} tokens needs {per_block} bytes)")
    return num_blocks


def allocate_kv_caches(num_blocks: int, arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """Per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
