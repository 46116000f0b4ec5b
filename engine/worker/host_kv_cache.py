"""The host tier's bytes on one rank: a host-memory buffer shaped like the rank's KV cache,
slots in place of blocks, and the copies the scheduler asks for (engine/core/host_tier.py
decides which).

    device  [layers, 2, num_blocks, bs, kv heads, d]   (allocate_kv_caches: one allocation)
    host    [layers, 2, num_slots,  bs, kv heads, d]   (pinned on CUDA)

    offloads: device[:, :, block_ids] ──▶ host[:, :, slots]     first
    onloads:  host[:, :, slots]       ──▶ device[:, :, block_ids]  then; then the forward

Each direction is one gather and one scatter over every layer at once, whatever the number
of blocks. The copies are synchronous on the engine's stream: a device -> host copy returns
once the bytes are on the host, and a host -> device copy is ordered before the forward that
reads it by the stream itself; a side stream would need events to prove the same.
"""
from __future__ import annotations

import torch

from pdserve.engine.worker.kv_cache import stacked_kv_caches


class HostKVCache:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int):
        """`kv_caches`: this rank's per-layer caches; `num_slots`: blocks the host holds (0: none)."""
        self.device_cache = stacked_kv_caches(kv_caches)
        layers, two, _, bs, heads, dim = self.device_cache.shape
        pin = self.device_cache.device.type == "cuda"
        self.host_cache = torch.empty((layers, two, num_slots, bs, heads, dim), dtype=self.device_cache.dtype,
                                      pin_memory=pin)

    @property
    def num_slots(self) -> int:
        return self.host_cache.shape[2]

    def copy(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        """`offloads` (device block id, host slot), then `onloads` (host slot, device block id)."""
        if offloads:
            block_ids, slots = zip(*offloads)
            data = self.device_cache.index_select(2, self._index(block_ids, self.device_cache.device))
            self.host_cache.index_copy_(2, self._index(slots), data.cpu())
        if onloads:
            slots, block_ids = zip(*onloads)
            data = self.host_cache.index_select(2, self._index(slots))
            device = self.device_cache.device
            self.device_cache.index_copy_(2, self._index(block_ids, device), data.to(device))

    @staticmethod
    def _index(ids, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=device)


class NoHostKVCache:
    """Offloading off: no buffer, and the scheduler never asks for a copy."""
    num_slots = 0

    def copy(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None:
        if offloads or onloads:
            raise RuntimeError("host KV copies asked of an engine without a host tier")


def host_kv_cache(kv_caches: list[torch.Tensor], num_slots: int) -> HostKVCache | NoHostKVCache:
    return HostKVCache(kv_caches, num_slots) if num_slots else NoHostKVCache()
