"""The host tier and the cache manager over it: exact slots, LRU eviction order, pinning
within a step, the copies a step makes, and the events of both tiers."""
from __future__ import annotations

import pytest

from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.core.block_hash import hash_full_blocks, model_fingerprint
from pdserve.engine.core.host_tier import HostTier
from pdserve.engine.core.kv_cache_manager import KVCacheManager, PrefixHits
from pdserve.engine.core.cache_events import KVEventKind, KVEventLog, KVTier
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams

ROOT = model_fingerprint("m", "float32", 2, 2, 16, 4)
STORED, REMOVED = KVEventKind.STORED, KVEventKind.REMOVED
DEVICE, HOST = KVTier.DEVICE, KVTier.HOST
H = [bytes([i]) * 32 for i in range(10)]  # stand-in hashes for the tier alone


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(EngineRequest(req_id, tokens, SamplingParams(max_tokens=4)))


def _tier(num_slots: int) -> tuple[HostTier, KVEventLog]:
    log = KVEventLog()
    return HostTier(num_slots, log), log


# ---- the tier alone ----------------------------------------------------------------
def test_slots_in_order_then_lru_eviction():
    tier, log = _tier(3)
    for block_id, h in zip([7, 8, 9], H[:3]):
        tier.offload(block_id, h)
    assert tier.take_copies() == ([(7, 0), (8, 1), (9, 2)], [])
    tier.offload(4, H[3])  # full: the least recently used (H0) gives up its slot
    assert tier.take_copies() == ([(4, 0)], [])
    assert tier.block_hashes() == [H[1], H[2], H[3]] and tier.slot_of(H[0]) is None
    assert (tier.num_evictions, tier.num_offloaded_blocks, tier.num_used_slots) == (1, 4, 3)
    events, _ = log.drain()
    assert events == [(STORED, h, HOST) for h in H[:3]] + [(REMOVED, H[0], HOST), (STORED, H[3], HOST)]


def test_a_hit_or_a_repeated_offload_makes_a_hash_recent():
    tier, log = _tier(3)
    for block_id, h in enumerate(H[:3]):
        tier.offload(block_id, h)
    tier.take_copies()
    tier.pin([H[0]])                      # a prefix hit on H0
    tier.onload([H[0]], [5])
    tier.offload(6, H[1])                 # H1 again: no copy, recent
    assert tier.take_copies() == ([], [(0, 5)])
    tier.offload(7, H[3])                 # evicts H2, the only one not used since
    assert tier.take_copies() == ([(7, 2)], [])
    assert tier.block_hashes() == [H[0], H[1], H[3]]


def test_a_slot_changes_at_most_once_a_step():
    """A slot this step's copies write or read keeps its hash until they have run: an
    offload finding every slot pinned is dropped, not written over a pending copy."""
    tier, _ = _tier(2)
    tier.offload(0, H[0])
    tier.offload(1, H[1])
    tier.offload(2, H[2])                 # both slots written this step: dropped
    assert tier.take_copies() == ([(0, 0), (1, 1)], [])
    assert tier.num_dropped == 1 and tier.slot_of(H[2]) is None
    tier.pin([H[1]])                      # read this step
    tier.onload([H[1]], [9])
    tier.offload(3, H[3])                 # takes H0's slot, not the pinned H1's
    assert tier.take_copies() == ([(3, 0)], [(1, 9)])
    tier.offload(4, H[4])                 # pins cleared: H1, the least recently used now, goes
    assert tier.take_copies() == ([(4, 1)], [])


def test_find_run_is_the_leading_run_and_moves_nothing():
    tier, _ = _tier(4)
    for block_id, h in enumerate([H[0], H[1], H[3]]):
        tier.offload(block_id, h)
    assert tier.find_run([H[0], H[1], H[2], H[3]]) == [H[0], H[1]]
    assert tier.find_run([H[2], H[3]]) == []
    assert tier.block_hashes() == [H[0], H[1], H[3]]


def test_a_tier_needs_a_slot():
    with pytest.raises(ValueError, match="num_slots"):
        HostTier(0, KVEventLog())


# ---- the cache manager over it -------------------------------------------------------
def test_evicted_blocks_go_to_host_and_a_prefix_hit_brings_them_back():
    kv = KVCacheManager(num_blocks=4, block_size=4, root_hash=ROOT, num_host_slots=8)
    h = hash_full_blocks(ROOT, list(range(12)), 4)
    hc = hash_full_blocks(ROOT, [7] * 16, 4)
    a = _request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    kv.free(a)                            # free queue: 3, 2, 1, 0 (h2, h1, h0)
    c = _request("c", [7] * 16)
    kv.allocate_slots(c, 16)              # takes 3, then evicts 2, 1, 0: offloaded
    assert kv.get_block_ids("c") == [3, 2, 1, 0]
    assert kv.take_host_copies() == ([(2, 0), (1, 1), (0, 2)], [])
    kv.free(c)                            # free queue: 0, 1, 2, 3
    kv.pool.take_kv_events()

    b = _request("b", list(range(12)) + [50])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert hits == PrefixHits([], [h[0], h[1], h[2]]) and num_hit_tokens == 12
    assert kv.num_local_blocks(h) == 3
    assert [blk.block_id for blk in kv.allocate_slots(b, 1, hits)] == [0, 1, 2, 3]
    # c's blocks go to host slots 3-6 first; then h0, h1, h2 come back from slots 2, 1, 0
    assert kv.take_host_copies() == ([(0, 3), (1, 4), (2, 5), (3, 6)], [(2, 0), (1, 1), (0, 2)])
    assert [kv.pool.get_cached_block(x).block_id for x in h] == [0, 1, 2]  # the device has them again
    assert kv.host.block_hashes() == [h[0], h[1], h[2], *hc[::-1]]         # ...and so has the host
    events = kv.pool.take_kv_events().events
    assert [e for e in events if e[1] in h] == [(STORED, x, DEVICE) for x in h]
    assert (kv.host.num_offloaded_blocks, kv.host.num_onloaded_blocks) == (7, 3)


def test_device_hits_then_host_hits_then_new_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT, num_host_slots=8)
    h = hash_full_blocks(ROOT, list(range(16)), 4)
    a = _request("a", list(range(16)) + [99])
    kv.allocate_slots(a, 17)              # blocks 0-4; h0-h3 in 0-3
    kv.free(a)                            # free queue: 5, 6, 7, 4, 3, 2, 1, 0
    x = _request("x", [8] * 20)
    kv.allocate_slots(x, 20)              # takes 5, 6, 7, 4, then evicts 3 (h3): host slot 0
    kv.free(x)                            # free queue: 2, 1, 0, 3, 4, 7, 6, 5
    assert kv.take_host_copies() == ([(3, 0)], [])
    b = _request("b", list(range(16)) + [60, 61])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits.device] == [0, 1, 2] and hits.host == [h[3]]
    assert num_hit_tokens == 16
    assert [blk.block_id for blk in kv.allocate_slots(b, 2, hits)] == [3, 4]
    assert kv.get_block_ids("b") == [0, 1, 2, 3, 4]
    # x's last two blocks leave for slots 1, 2; h3 comes back from slot 0 into block 3
    assert kv.take_host_copies() == ([(3, 1), (4, 2)], [(0, 3)])


def test_pinned_hits_outlive_the_offloads_of_their_own_allocation():
    """Two host slots, both holding the hits: the device blocks evicted to make room for them
    are dropped, never written over the slots being read."""
    kv = KVCacheManager(num_blocks=3, block_size=4, root_hash=ROOT, num_host_slots=2)
    a = _request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    kv.allocate_slots(_request("c", [7] * 12), 12)  # evicts a's h1, h0 into slots 0, 1
    kv.free(_request("c", [7] * 12))
    kv.take_host_copies()
    b = _request("b", list(range(8)) + [5])
    hits, _ = kv.get_computed_blocks(b)
    assert len(hits.host) == 2
    kv.allocate_slots(b, 1, hits)         # evicts c's 3 cached blocks: nowhere to keep them
    assert kv.take_host_copies() == ([], [(1, 0), (0, 1)])
    assert kv.host.num_dropped == 3


def test_a_failed_allocation_pins_and_copies_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, root_hash=ROOT, num_host_slots=4)
    a = _request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    kv.allocate_slots(_request("c", [7] * 12), 12)  # a's blocks to the host; c holds all 3
    kv.take_host_copies()
    b = _request("b", list(range(8)) + [5])
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, hits) is None
    assert kv.take_host_copies() == ([], [])


def _replay(held: dict, events) -> dict:
    if events.snapshot is not None:
        held = {DEVICE: set(), HOST: set()}
        for block_hash, tier in events.snapshot:
            held[tier].add(block_hash)
    for kind, block_hash, tier in events.events:
        (held[tier].add if kind == STORED else held[tier].discard)(block_hash)
    return held


@pytest.mark.parametrize("max_events", [65536, 7])
def test_replayed_events_equal_both_tiers_through_many_evictions(max_events):
    """Events (or, when the log overflows, the snapshot) give exactly what each tier holds."""
    kv = KVCacheManager(num_blocks=8, block_size=4, root_hash=ROOT, num_host_slots=6)
    kv.pool.kv_events.max_events = max_events
    held: dict = {DEVICE: set(), HOST: set()}
    num_host_hits = num_snapshots = 0
    for i in range(40):  # prompts sharing prefixes of varying length, in pools that keep evicting
        r = _request(f"r{i}", [i % 3] * (4 * (i % 5)) + list(range(100 * i, 100 * i + 9)))
        hits, num_hit = kv.get_computed_blocks(r)
        num_host_hits += len(hits.host)
        assert kv.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
        kv.take_host_copies()
        events = kv.pool.take_kv_events()
        num_snapshots += events.snapshot is not None
        held = _replay(held, events)
        assert held[DEVICE] == set(kv.pool.cached_block_hash_to_block)
        assert held[HOST] == set(kv.host.block_hashes())
        kv.free(r)
    assert num_host_hits > 0 and kv.host.num_evictions > 0
    assert (num_snapshots > 0) == (max_events < 100)  # the small log overflows: snapshots of both tiers


def test_offloading_needs_prefix_caching():
    with pytest.raises(ValueError, match="kv_offloading_bytes"):
        KVCacheManager(num_blocks=4, block_size=4, root_hash=ROOT, enable_prefix_caching=False, num_host_slots=4)
    with pytest.raises(ValueError, match="kv_offloading_bytes.*enable_prefix_caching"):
        CacheConfig(enable_prefix_caching=False, kv_offloading_bytes=1 << 20)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="kv_offloading_bytes"):
            CacheConfig(kv_offloading_bytes=bad)
    CacheConfig(enable_prefix_caching=False, kv_offloading_bytes=0)  # off: fine either way


# ---- the scheduler hands the copies to the runner ------------------------------------
def test_the_step_carries_its_copies_and_counts_host_hits():
    kv = KVCacheManager(num_blocks=5, block_size=4, root_hash=ROOT, num_host_slots=8)
    s = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=64), kv)
    s.add_request(_request("a", list(range(12)) + [1]))      # 4 blocks: h0-h2, the tail
    assert s.schedule().kv_offloads == []
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    s.add_request(_request("c", [7] * 17))                   # 5 blocks: evicts a's 3 cached ones
    out = s.schedule()
    assert sorted(slot for _, slot in out.kv_offloads) == [0, 1, 2] and out.kv_onloads == []
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    s.add_request(_request("b", list(range(12)) + [2, 3]))
    out = s.schedule()
    assert len(out.kv_onloads) == 3 and out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens == {"b": 2}
    assert (kv.num_hit_tokens, kv.num_host_hit_tokens) == (0, 12)
    assert kv.num_host_queried_tokens == 13 + 17 + 14
