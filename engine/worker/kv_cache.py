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


def export_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """Copy blocks out of the per-layer caches to host memory, in the KVPayload layout."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    per_layer = [cache.index_select(1, index) for cache in kv_caches]  # [2, n, bs, h, d] each
    return torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def import_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], blocks: torch.Tensor) -> None:
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    data = blocks.to(device=kv_caches[0].device, dtype=kv_caches[0].dtype)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, data[:, layer].transpose(0, 1))
