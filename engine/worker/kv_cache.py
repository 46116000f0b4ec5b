"""Sizing and allocating the paged KV cache: one preallocated pool per layer."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.config import CacheConfig, ModelArchConfig
from pdserve.engine.kv_transfer import BlockChunks
from pdserve.engine.worker.host_memory import available_host_memory

if TYPE_CHECKING:
    from pdserve.engine.worker.memory_profile import MemoryProfile


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_memory()


def num_kv_blocks(cache: CacheConfig, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                  num_ranks: int = 1, profile: MemoryProfile | None = None) -> int:
    """`arch`: one rank's part (its layers and KV heads). kv_cache_memory_bytes is each
    rank's budget (as on GPUs, one per rank). Without it: on a CUDA engine that measured
    `profile` (memory_profile.py), what gpu_memory_utilization leaves; else the fraction of
    free memory, each rank's on a GPU, while ranks on the CPU share the host's memory and
    split the fraction."""
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    budget, field = kv_budget(cache, device, num_ranks, profile)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"{field}: a budget of {budget} bytes holds no KV block "
                         f"(one block of {cache.block_size} tokens needs {per_block} bytes)")
    return num_blocks


def num_host_kv_slots(cache: CacheConfig, arch: ModelArchConfig, dtype: torch.dtype, num_ranks: int = 1) -> int:
    """Blocks the host tier holds: kv_offloading_bytes over every rank together (vLLM's
    --kv-offloading-size is the total of all ranks), each rank keeping its part of a block
    (`arch`: one rank's part). 0: no host tier."""
    if not cache.kv_offloading_bytes:
        return 0
    per_block = bytes_per_block(arch, cache.block_size, dtype) * num_ranks
    num_slots = cache.kv_offloading_bytes // per_block
    if num_slots < 1:
        raise ValueError(f"kv_offloading_bytes: {cache.kv_offloading_bytes} bytes hold no KV block "
                         f"(one block of {cache.block_size} tokens needs {per_block} bytes over {num_ranks} rank(s))")
    return num_slots


def kv_budget(cache: CacheConfig, device: torch.device, num_ranks: int,
              profile: MemoryProfile | None) -> tuple[int, str]:
    """The KV cache's bytes on one rank, and the setting that decided them."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if profile is not None:
        return profile.kv_budget(cache.gpu_memory_utilization), "gpu_memory_utilization"
    share = 1 if device.type == "cuda" else num_ranks
    return int(cache.kv_cache_memory_fraction * available_memory(device) / share), "kv_cache_memory_fraction"


def allocate_kv_caches(num_blocks: int, arch: ModelArchConfig, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """Per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], each a view of
    one allocation in layer order, so that a copy of many blocks across every layer is one
    indexed op (stacked_kv_caches; the host tier's copies)."""
    shape = (arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return list(torch.zeros(shape, dtype=dtype, device=device).unbind(0))


def stacked_kv_caches(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """The per-layer caches of allocate_kv_caches (or a leading run of them) as one tensor
    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], sharing their memory."""
    first = kv_caches[0]
    step = first.numel()
    for i, cache in enumerate(kv_caches):
        if (cache.shape != first.shape or not cache.is_contiguous()
                or cache.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or cache.storage_offset() != first.storage_offset() + i * step):
            raise ValueError("KV caches: not consecutive views of one allocation (allocate_kv_caches)")
    return first.as_strided((len(kv_caches), *first.shape), (step, *first.stride()), first.storage_offset())


def export_blocks(kv_caches: list[torch.Tensor], block_ids: list[int],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy blocks out of the per-layer caches into one contiguous host tensor in the
    KVPayload layout (the wire layout: a block's layers, K and V, back to back), which the
    kvstore client sends as it is. `out`: host memory to write them into (contiguous, of
    that shape and the cache's dtype), e.g. a buffer the kvstore client's data plane
    reads from in place; by default a new tensor.

        cache[layer]: [2, num_blocks, bs, h, d] ──gather block_ids──▶ out[:, layer]: [n, 2, bs, h, d]

    Per layer one gather (index_select, fast and contiguous) and one strided copy into
    the output: measured faster on CPU than index_select writing into the strided slot
    itself, which takes a slow path. On a GPU the output is a device tensor first, then
    one transfer brings it to (pinned) host memory.
    """
    cache0 = kv_caches[0]
    num_layers, (two, _, bs, h, d) = len(kv_caches), cache0.shape
    index = torch.tensor(block_ids, dtype=torch.long, device=cache0.device)
    shape = (len(block_ids), num_layers, two, bs, h, d)
    if out is not None and (tuple(out.shape) != shape or out.dtype != cache0.dtype or out.device.type != "cpu"
                            or not out.is_contiguous()):
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype} on {out.device}, not {shape} {cache0.dtype} "
                         "contiguous on the host")
    on_host = cache0.device.type == "cpu"
    gathered = out if out is not None and on_host else torch.empty(shape, dtype=cache0.dtype, device=cache0.device)
    for layer, cache in enumerate(kv_caches):
        # the gather keeps the cache's [2, n, ...] order; gathered[:, layer] transposed is that order
        gathered[:, layer].transpose(0, 1).copy_(cache.index_select(1, index))
    if on_host:
        return gathered
    host = out if out is not None else torch.empty(shape, dtype=cache0.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(gathered)


def import_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], blocks: torch.Tensor | BlockChunks) -> None:
    if isinstance(blocks, BlockChunks):  # chunk by chunk, never joined
        for offset, chunk in blocks.pieces():
            import_blocks(kv_caches, block_ids[offset:offset + chunk.shape[0]], chunk)
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    data = blocks.to(device=kv_caches[0].device, dtype=kv_caches[0].dtype)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, data[:, layer].transpose(0, 1))
