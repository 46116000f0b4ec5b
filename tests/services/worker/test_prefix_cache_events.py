"""A worker's KV events keep the engine's tier: device and host blocks reach a tier-aware
router apart, in the engine's order; a snapshot from the engine replaces both tiers."""
from __future__ import annotations

from types import SimpleNamespace

from pdserve.engine.core.cache_events import KVEventKind, KVEvents, KVTier
from pdserve.services.common.kv_event_publisher import DEVICE, HOST, REMOVED, STORED
from pdserve.services.worker.prefix_cache_events import WorkerKVEvents

INFO = SimpleNamespace(block_size=16, root_hash=b"root")  # all the publisher reads of EngineInfo


def _tiered(batch):
    return [(e.kind, e.tier, list(e.block_hashes)) for e in batch.events]


def test_engine_tiers_are_published_as_they_happened():
    kv = WorkerKVEvents(INFO)
    stream = kv.publisher.stream(lambda: True, tiers=[DEVICE, HOST])
    assert next(stream).snapshot
    stored, removed = KVEventKind.STORED, KVEventKind.REMOVED
    # a block the device evicts moves to host memory: REMOVED(DEVICE), then STORED(HOST)
    kv.on_events(KVEvents([(stored, b"a", KVTier.DEVICE), (stored, b"b", KVTier.DEVICE),
                           (removed, b"b", KVTier.DEVICE), (stored, b"b", KVTier.HOST)]))
    batch = next(stream)
    assert (batch.block_size, batch.root_hash) == (16, b"root")
    assert _tiered(batch) == [(STORED, DEVICE, [b"a", b"b"]), (REMOVED, DEVICE, [b"b"]), (STORED, HOST, [b"b"])]
    assert kv.publisher.num_held_by_tier() == {DEVICE: 1, HOST: 1}
    kv.close()


def test_an_engine_snapshot_replaces_every_tier():
    kv = WorkerKVEvents(INFO)
    kv.on_events(KVEvents([(KVEventKind.STORED, b"gone", KVTier.DEVICE)]))
    kv.on_events(KVEvents(snapshot=[(b"d", KVTier.DEVICE), (b"h", KVTier.HOST)]))
    stream = kv.publisher.stream(lambda: True, tiers=[DEVICE, HOST])
    assert _tiered(next(stream)) == [(STORED, DEVICE, [b"d"]), (STORED, HOST, [b"h"])]
    device_only = kv.publisher.stream(lambda: True)  # a router from before tiers
    assert _tiered(next(device_only)) == [(STORED, DEVICE, [b"d"])]
    kv.close()
