"""A worker's prefix cache as KVEvents: the engine loop drains the engine's events after
each step (engine/core/cache_events.py) and hands them here; routers subscribe over gRPC
(services/common/kv_event_publisher.py). Each event keeps its engine tier: DEVICE (the KV cache
the model reads) or HOST (host memory, blocks the device evicted), which a router scores
apart (a host hit costs a copy back)."""
from __future__ import annotations

from pdserve.engine.core.cache_events import KVEventKind, KVEvents, KVTier
from pdserve.engine.info import EngineInfo
from pdserve.services.common.kv_event_publisher import DEVICE, HOST, REMOVED, STORED, KVEventPublisher

_KINDS = {KVEventKind.STORED: STORED, KVEventKind.REMOVED: REMOVED}
_TIERS = {KVTier.DEVICE: DEVICE, KVTier.HOST: HOST}


class WorkerKVEvents:
    """The engine side of a worker's publisher; `on_events` runs on the engine loop thread."""

    def __init__(self, info: EngineInfo):
        # routers hash prompts with the engine's block size and root hash (engine/info.py)
        self.publisher = KVEventPublisher(info.block_size, info.root_hash)

    def on_events(self, events: KVEvents) -> None:
        if events.snapshot is not None:
            self.publisher.replace((block_hash, _TIERS[tier]) for block_hash, tier in events.snapshot)
        self.publisher.publish_tiered((_KINDS[kind], block_hash, _TIERS[tier])
                                      for kind, block_hash, tier in events.events)

    def close(self) -> None:
        self.publisher.close()
