"""The kvstore's full blocks as KVEvents (proto/pdserve/v1/kv_events.proto): routers
learn which prompt prefixes any worker could import from here instead of computing
(services/router/state/kv_index.py). Tails are request-scoped and never published.

Only the in-process memory backend reports its changes; with Redis the stream stays
empty (a router then counts on no kvstore hits, as before it had an index).
"""
from __future__ import annotations

from pdserve.services.common.kv_event_publisher import REMOVED, STORED, KVEventPublisher
from pdserve.services.kvstore.kv_metrics import KVStoreMetrics
from pdserve.services.kvstore.stores.base import HASH_PREFIX


class PublishingMetrics(KVStoreMetrics):
    """The kvstore's metrics (its StoreEvents sink), also publishing block changes."""

    def __init__(self, publisher: KVEventPublisher):
        super().__init__()
        self.publisher = publisher

    def blocks_changed(self, evicted: list[bytes], stored: list[bytes]) -> None:
        n = len(HASH_PREFIX)
        self.publisher.publish([*((REMOVED, k[n:]) for k in evicted if k.startswith(HASH_PREFIX)),
                                *((STORED, k[n:]) for k in stored if k.startswith(HASH_PREFIX))])
