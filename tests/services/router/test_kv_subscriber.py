"""The router's KV index fed by KVEvents streams with tiers: a publisher's batches replayed
into the index give its blocks per tier; tiers the router does not know are skipped; over
real gRPC the subscription asks for the host tier and gets it; the metrics show each tier."""
from __future__ import annotations

import time

from pdserve.engine.core.block_hash import hash_full_blocks, model_fingerprint
from pdserve.services.common.grpc_server import start_server
from pdserve.services.common.kv_event_publisher import DEVICE, HOST, REMOVED, STORED, KVEventPublisher, kv_events_service
from pdserve.services.pb import kv_events_pb2
from pdserve.services.router.config import default_slo_classes
from pdserve.services.router.metrics import RouterMetrics
from pdserve.services.router.state import kv_index
from pdserve.services.router.state.kv_index import BlockNaming, KVIndex
from pdserve.services.router.state.kv_subscriber import KVSubscription, index_events

ROOT = model_fingerprint("m", "float32", 2, 2, 16, 4)
PROMPT = list(range(100, 117))  # 4 full blocks + 1 token
H = hash_full_blocks(ROOT, PROMPT, 4)


def _replay(index: KVIndex, source: str, batches) -> None:
    """What KVSubscription does with each batch, without its thread."""
    for batch in batches:
        if batch.snapshot:
            index.reset(source, BlockNaming(batch.block_size, batch.root_hash), index_events(batch))
        else:
            index.apply(source, index_events(batch))


def _runs(index: KVIndex, source: str) -> tuple[int, int]:
    m = index.match([source], PROMPT)
    return m.local_tokens[source], m.host_tokens[source]


def test_replayed_batches_give_the_publishers_blocks_per_tier():
    pub = KVEventPublisher(block_size=4, root_hash=ROOT)
    pub.publish_tiered([(STORED, h, DEVICE) for h in H])
    stream = pub.stream(lambda: True, tiers=[DEVICE, HOST])
    index = KVIndex()
    _replay(index, "w", [next(stream)])
    assert _runs(index, "w") == (16, 0)
    pub.publish_tiered([(REMOVED, H[3], DEVICE), (STORED, H[3], HOST), (REMOVED, H[2], DEVICE), (STORED, H[2], HOST)])
    _replay(index, "w", [next(stream)])
    assert _runs(index, "w") == (8, 8)
    assert index.num_blocks_by_tier() == {"w": {kv_index.DEVICE: 2, kv_index.HOST: 2}}
    pub.replace([(H[0], HOST)])  # the worker lost its log: a snapshot of both tiers
    _replay(index, "w", [next(stream)])
    assert _runs(index, "w") == (0, 4)
    stream.close()


def test_kinds_and_tiers_the_router_does_not_know_are_skipped():
    batch = kv_events_pb2.KVEventBatch(events=[
        kv_events_pb2.KVEvent(kind=STORED, tier=DEVICE, block_hashes=[b"d"]),
        kv_events_pb2.KVEvent(kind=STORED, tier=7, block_hashes=[b"disk"]),  # a newer source's tier
        kv_events_pb2.KVEvent(kind=9, tier=HOST, block_hashes=[b"x"]),
        kv_events_pb2.KVEvent(kind=REMOVED, tier=HOST, block_hashes=[b"h"])])
    assert [(k, list(hs), t) for k, hs, t in index_events(batch)] == [
        (kv_index.STORED, [b"d"], kv_index.DEVICE), (kv_index.REMOVED, [b"h"], kv_index.HOST)]


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_subscription_asks_for_the_host_tier_over_grpc():
    pub = KVEventPublisher(block_size=4, root_hash=ROOT)
    pub.publish_tiered([(STORED, H[0], DEVICE), (STORED, H[1], HOST)])
    server = start_server([kv_events_service(pub)])
    address = f"127.0.0.1:{server.port}"
    index = KVIndex()
    sub = KVSubscription(address, index, min_backoff_s=0.01, max_backoff_s=0.05).start()
    try:
        _wait_for(lambda: _runs(index, address) == (4, 4))  # a device-only subscriber would see (4, 0)
        pub.publish_tiered([(STORED, H[2], HOST)])
        _wait_for(lambda: _runs(index, address) == (4, 8))
    finally:
        sub.stop()
        pub.close()
        server.stop(grace=None)


def test_metrics_show_each_workers_tiers_and_the_kvstore_as_store():
    index = KVIndex()
    index.reset("w:1", BlockNaming(4, ROOT), [(kv_index.STORED, H[:3], kv_index.DEVICE),
                                              (kv_index.STORED, H[3:], kv_index.HOST)])
    index.reset("kv:2", None, [(kv_index.STORED, H, kv_index.DEVICE)])
    metrics = RouterMetrics(default_slo_classes())
    metrics.update_kv_index(index, kvstore_address="kv:2")
    value = metrics.metrics.value
    assert value("router_kv_index_blocks", {"source": "w:1", "tier": "device"}) == 3
    assert value("router_kv_index_blocks", {"source": "w:1", "tier": "host"}) == 1
    assert value("router_kv_index_blocks", {"source": "kv:2", "tier": "store"}) == 4
    assert value("router_kv_index_blocks", {"source": "kv:2", "tier": "device"}) == 0  # no such series
