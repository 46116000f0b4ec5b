"""A worker's prefix cache as KVEvents: the engine loop drains the engine's events after
each step (engine/core/kv_events.py) and hands them here; routers subscribe over gRPC
(services/common/kv_events.py)."""
from __future__ import annotations

from engine.core.kv_events import KVEventKind, KVEvents, KVTier
from engine.info import EngineInfo
from services.common.kv_events import REMOVED, STORED, KVEventPublisher

_KINDS = {KVEventKind.STORED: STORED, KVEventKind.REMOVED: REMOVED}


class WorkerKVEvents:
    """The engine side of a worker's publisher; `on_events` runs on the engine loop thread."""

    def __init__(self, info: EngineInfo):
        # routers hash prompts with the engine's block size and root hash (engine/info.py)
        self.publisher = KVEventPublisher(info.block_size, info.root_hash)

    def on_events(self, events: KVEvents) -> None:
        # the device tier only, until the router's index scores tiers apart
        if events.snapshot is not None:
            self.publisher.replace(h for h, tier in events.snapshot if tier is KVTier.DEVICE)
        self.publisher.publish((_KINDS[kind], block_hash) for kind, block_hash, tier in events.events
                               if tier is KVTier.DEVICE)

    def close(self) -> None:
        self.publisher.close()
