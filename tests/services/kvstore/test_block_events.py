"""The kvstore's full blocks as KV events: puts publish new hashes, evictions removed
ones, tails never; replayed, they equal what the store holds."""
from __future__ import annotations

from pdserve.services.common.kv_event_publisher import REMOVED, STORED, KVEventPublisher
from pdserve.services.kvstore.block_events import PublishingMetrics
from pdserve.services.kvstore.stores.memory import MemoryBlockStore
from pdserve.services.kvstore.stores.base import hash_key
from tests.services.kvstore.conftest import block


def _events(stream) -> list[tuple[int, list[bytes]]]:
    return [(e.kind, list(e.block_hashes)) for e in next(stream).events]


def test_puts_and_evictions_are_published_tails_are_not():
    publisher = KVEventPublisher()
    store = MemoryBlockStore(30, PublishingMetrics(publisher))
    stream = publisher.stream(lambda: True)
    assert next(stream).snapshot
    store.put([block("a", 10), block("b", 10), block("t:req", 10)])
    assert _events(stream) == [(STORED, [b"a", b"b"])]
    store.put([block("a", 10)])  # already stored: nothing new
    store.put([block("c", 10), block("d", 10)])  # evicts the least recent: b, then t:req
    assert _events(stream) == [(REMOVED, [b"b"]), (STORED, [b"c", b"d"])]
    assert publisher.num_held == 3
    assert [b is not None for b in store.get([hash_key(h) for h in (b"a", b"c", b"d")])] == [True] * 3
    stream.close()
