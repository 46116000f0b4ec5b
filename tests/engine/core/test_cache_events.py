"""The block pool's KV events: replayed in order, they give exactly the prefix cache's
hashes, through stores, prefix hits, eviction under pressure and a lost log."""
from __future__ import annotations

from pdserve.engine.core.block_hash import hash_full_blocks, model_fingerprint
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.cache_events import KVEventKind, KVEventLog, KVTier
from pdserve.engine.request import Request
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams

ROOT = model_fingerprint("m", "float32", 2, 2, 16, 4)
STORED, REMOVED = KVEventKind.STORED, KVEventKind.REMOVED
DEVICE = KVTier.DEVICE


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(EngineRequest(req_id, tokens, SamplingParams(max_tokens=4)))


def _replay(held: set[bytes], kv: KVCacheManager) -> set[bytes]:
    events = kv.pool.take_kv_events()
    if events.snapshot is not None:
        held = {h for h, tier in events.snapshot if tier is DEVICE}
    for kind, block_hash, tier in events.events:
        assert tier is DEVICE  # no host tier configured
        (held.add if kind == STORED else held.discard)(block_hash)
    return held


def test_events_follow_stores_hits_and_eviction_under_pressure():
    kv = KVCacheManager(num_blocks=6, block_size=4, root_hash=ROOT)
    a = _request("a", list(range(10)))  # 2 full blocks + 2 tokens
    h = hash_full_blocks(ROOT, list(range(10)), 4)
    kv.allocate_slots(a, 10)
    assert kv.pool.take_kv_events().events == [(STORED, h[0], DEVICE), (STORED, h[1], DEVICE)]
    kv.free(a)
    assert kv.pool.take_kv_events().is_empty  # freed blocks stay cached: nothing changed

    b = _request("b", list(range(8)) + [99, 98, 97])
    hits, _ = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 3, hits)
    kv.free(b)
    assert kv.pool.take_kv_events().is_empty  # a prefix hit stores nothing new

    # 5 blocks in a pool of 6: uncached free blocks first, then cached block 1 is evicted
    c = _request("c", [7] * 20)
    hc = hash_full_blocks(ROOT, [7] * 20, 4)
    kv.allocate_slots(c, 20)
    assert kv.pool.take_kv_events().events == [(REMOVED, h[1], DEVICE)] + [(STORED, x, DEVICE) for x in hc]
    assert set(kv.pool.cached_block_hash_to_block) == {h[0], *hc}


def test_replayed_events_equal_the_cache_through_many_evictions():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT)
    held: set[bytes] = set()
    for i in range(30):  # prompts sharing prefixes of varying length, in a pool that keeps evicting
        r = _request(f"r{i}", [i % 3] * (4 * (i % 4)) + list(range(100 * i, 100 * i + 9)))
        hits, num_hit = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
        held = _replay(held, kv)
        assert held == set(kv.pool.cached_block_hash_to_block)
        kv.free(r)
    assert kv.pool.num_evictions > 10


def test_a_lost_log_is_replaced_by_a_snapshot():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT)
    kv.pool.kv_events = KVEventLog(max_events=2)
    kv.allocate_slots(_request("a", list(range(20))), 20)  # 5 stores into a log of 2
    events = kv.pool.take_kv_events()
    assert events.events == [] and {h for h, _ in events.snapshot} == set(kv.pool.cached_block_hash_to_block)
    assert len(events.snapshot) == 5
    kv.allocate_slots(_request("b", list(range(50, 54))), 4)
    assert kv.pool.take_kv_events().events == [(STORED, hash_full_blocks(ROOT, list(range(50, 54)), 4)[0], DEVICE)]


def test_prefix_caching_off_publishes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, root_hash=ROOT, enable_prefix_caching=False)
    kv.allocate_slots(_request("a", list(range(12))), 12)
    assert kv.pool.take_kv_events().is_empty
