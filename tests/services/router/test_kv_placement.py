"""The router's KV index and the KV-aware placement policy: pure functions over views,
tiers scored apart (device over host over store); and the pool reserving only what the
chosen worker will compute."""
from __future__ import annotations

import pytest

from pdserve.engine.core.block_hash import hash_full_blocks, model_fingerprint
from pdserve.services.pb import common_pb2
from pdserve.services.router.config import SaturationConfig
from pdserve.services.router.core.admission import AdmissionGate
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.pools import Need, Pool
from pdserve.services.router.decide.policy import (KV_HIT, KV_HOST_HIT, KV_LOAD, LEAST_LOADED, CountedPolicy, KVAwarePlacement,
                                                   MostRoomDecode, decode_load_tokens, kv_saved_tokens, prefill_load_tokens)
from pdserve.services.router.decide.saturation import SaturationPolicy
from pdserve.services.router.decide.views import PrefixMatch
from pdserve.services.router.decide.views import WorkerView
from pdserve.services.router.state.discovery import PREFILL, StaticDiscovery
from pdserve.services.router.state.kv_index import DEVICE, HOST, REMOVED, STORED, BlockNaming, KVIndex
from pdserve.services.router.state.workers import WorkerRegistry

ROOT = model_fingerprint("m", "float32", 2, 2, 16, 4)
NAMING = BlockNaming(4, ROOT)
PROMPT = list(range(100, 117))  # 4 full blocks + 1 token
H = hash_full_blocks(ROOT, PROMPT, 4)


def _on(device=(), host=()):
    """A snapshot's STORED events: these hashes on the device, those in host memory."""
    return [(STORED, list(device), DEVICE), (STORED, list(host), HOST)]


def test_match_counts_leading_blocks_only():
    index = KVIndex()
    index.reset("a", NAMING, _on(H[:3]))
    index.reset("b", NAMING, _on([H[0], H[2], H[3]]))  # h2 without h1 belongs to another prompt
    m = index.match(["a", "b", "c"], PROMPT)
    assert m.local_tokens == {"a": 12, "b": 4, "c": 0} and m.store_tokens == 0
    assert m.host_tokens == {"a": 0, "b": 0, "c": 0}


def test_the_last_prompt_token_is_never_a_hit():
    index = KVIndex()
    index.reset("a", NAMING, _on(H))
    assert index.match(["a"], PROMPT).local_tokens["a"] == 16       # 17 tokens: 4 blocks reusable
    assert index.match(["a"], PROMPT[:16]).local_tokens["a"] == 12  # 16 tokens: the 4th holds the last one


def test_events_apply_in_order_and_drop_forgets():
    index = KVIndex()
    index.apply("a", [(STORED, H, DEVICE)])  # no snapshot yet: ignored
    assert index.match(["a"], PROMPT).local_tokens["a"] == 0
    index.reset("a", NAMING)
    index.apply("a", [(STORED, H[:2], DEVICE), (REMOVED, [H[1]], DEVICE), (STORED, [H[1], H[2]], DEVICE)])
    assert index.match(["a"], PROMPT).local_tokens["a"] == 12
    index.apply("a", [(REMOVED, [H[0]], DEVICE)])
    assert index.match(["a"], PROMPT).local_tokens["a"] == 0
    index.drop("a")
    assert index.num_blocks() == {}


def test_kvstore_is_matched_with_the_workers_naming():
    index = KVIndex()
    index.reset("a", NAMING, _on(H[:1]))
    index.reset("store", None, [(STORED, H[:4], DEVICE)])  # the kvstore names no model: it holds what workers wrote
    assert index.match(["a"], PROMPT, store="store") == PrefixMatch({"a": 4}, 16, {"a": 0})


def test_memory_is_bounded_per_source_oldest_first():
    index = KVIndex(max_blocks_per_source=3)
    index.reset("a", NAMING, _on(H))
    assert index.num_blocks_by_tier() == {"a": {DEVICE: 3, HOST: 0}}
    assert index.match(["a"], PROMPT).local_tokens["a"] == 0  # h0 went first


def test_match_counts_the_device_run_then_the_host_run_after_it():
    """
        prompt  [ b0 | b1 | b2 | b3 | t ]
        c         D    D    H    H          device 8, host 8
        d         H    D    D               device 0, host 4: b1 on the device is past b0's copy back
        e         D    H    D    H          device 4, host 4: b2 is in no host run
        f         DH   H    H               device 4, host 8: a block in both tiers is on the device
    """
    index = KVIndex()
    index.reset("c", NAMING, _on(device=H[:2], host=H[2:]))
    index.reset("d", NAMING, _on(device=H[1:3], host=H[:1]))
    index.reset("e", NAMING, _on(device=[H[0], H[2]], host=[H[1], H[3]]))
    index.reset("f", NAMING, _on(device=H[:1], host=H[:3]))
    m = index.match(["c", "d", "e", "f", "g"], PROMPT)
    assert m.local_tokens == {"c": 8, "d": 0, "e": 4, "f": 4, "g": 0}
    assert m.host_tokens == {"c": 8, "d": 4, "e": 4, "f": 8, "g": 0}


def test_a_block_moving_to_host_memory_and_back_moves_its_tokens():
    index = KVIndex()
    index.reset("a", NAMING, _on(device=H))
    index.apply("a", [(REMOVED, H[2:], DEVICE), (STORED, H[2:], HOST)])  # the device evicted its tail
    m = index.match(["a"], PROMPT)
    assert (m.local_tokens["a"], m.host_tokens["a"]) == (8, 8)
    index.apply("a", [(STORED, [H[2]], DEVICE)])  # copied back (host memory keeps its copy)
    m = index.match(["a"], PROMPT)
    assert (m.local_tokens["a"], m.host_tokens["a"]) == (12, 4)
    assert index.num_blocks_by_tier() == {"a": {DEVICE: 3, HOST: 2}}
    index.apply("a", [(REMOVED, H[:1], DEVICE)])
    assert index.match(["a"], PROMPT).host_tokens["a"] == 0  # b0 is nowhere: no run at all


def test_the_kvstore_run_counts_from_the_first_block_whatever_the_workers_hold():
    index = KVIndex()
    index.reset("a", NAMING, _on(device=H[:1], host=H[1:2]))
    index.reset("store", None, [(STORED, H[:3], DEVICE)])
    assert index.match(["a"], PROMPT, store="store") == PrefixMatch({"a": 4}, 12, {"a": 4})


def test_the_bound_holds_per_tier():
    index = KVIndex(max_blocks_per_source=2)
    index.reset("a", NAMING, _on(device=H[:2], host=H[2:]))
    assert index.num_blocks_by_tier() == {"a": {DEVICE: 2, HOST: 2}}
    index.apply("a", [(STORED, H[:1], HOST)])  # the oldest host entry (h2) goes
    assert index.match(["a"], PROMPT).host_tokens["a"] == 0


def _w(address: str, **load) -> WorkerView:
    return WorkerView(address, up=True, **load)


def _policy(local: dict[str, int], store: int = 0, weight: float = 0.5, host: dict[str, int] | None = None,
            host_weight: float = 0.8):
    return KVAwarePlacement(lambda addresses, ids: PrefixMatch(local, store, host or {}), prefill_load_tokens,
                            weight, host_weight)


def test_kv_policy_prefers_the_longest_prefix_until_load_outweighs_it():
    policy = _policy({"a": 1000, "b": 200})
    near = [_w("a", num_queued_prefill_tokens=700), _w("b")]
    assert (policy.place(near, PROMPT).worker.address, policy.place(near, PROMPT).reason) == ("a", KV_HIT)
    assert policy.place(near, PROMPT).num_cached_tokens == 1000  # the pool reserves only the rest
    far = [_w("a", num_queued_prefill_tokens=900), _w("b")]  # 1000 - 900 < 200 - 0
    assert (policy.place(far, PROMPT).worker.address, policy.place(far, PROMPT).reason) == ("b", KV_LOAD)


def test_kv_policy_ties_go_to_the_least_loaded_then_the_first_listed():
    policy = _policy({"a": 400, "b": 400})  # the shared system prompt everywhere
    workers = [_w("a", num_queued_prefill_tokens=10), _w("b"), _w("c")]
    assert policy.place(workers[:2], PROMPT).worker.address == "b"
    assert policy.place(workers[:2], PROMPT).reason == LEAST_LOADED
    nothing = _policy({})
    assert nothing.place([_w("c"), _w("b")], PROMPT).worker.address == "c"
    assert nothing.place([], PROMPT) is None


def test_kvstore_hits_narrow_the_local_advantage():
    assert kv_saved_tokens(100, 1000, 0.5) == 550 and kv_saved_tokens(1000, 400, 0.5) == 1000
    workers = [_w("a", num_queued_prefill_tokens=600), _w("b")]
    assert _policy({"a": 1000}, store=0).choose(workers, PROMPT).address == "a"      # 400 vs 0
    assert _policy({"a": 1000}, store=1000).choose(workers, PROMPT).address == "b"   # 400 vs 500


def test_router_in_flight_tokens_count_as_load():
    policy = _policy({"a": 500})
    workers = [_w("a", in_flight_tokens=800), _w("b")]
    assert policy.choose(workers, PROMPT).address == "b"


def test_decode_load_is_most_room_decode_score_in_tokens():
    busy = _w("a", num_running=32, max_num_seqs=64, num_total_kv_blocks=100, num_free_kv_blocks=50,
              num_queued_prefill_tokens=100, in_flight=32, in_flight_tokens=5_000)
    assert decode_load_tokens(busy) == 5_000 + 2048 * (0.5 + 0.5)
    # with no prefix to reuse anywhere, KV placement picks MostRoomDecode's worker
    workers = [busy, _w("b", num_running=4, max_num_seqs=64, num_total_kv_blocks=100, num_free_kv_blocks=90,
                       in_flight_tokens=3_000)]
    policy = KVAwarePlacement(lambda addresses, token_ids: PrefixMatch({}, 0), decode_load_tokens, 0.5)
    assert policy.choose(workers, PROMPT).address == MostRoomDecode().choose(workers, PROMPT).address == "b"


def test_counted_policy_reports_each_decision_once():
    counted = []
    policy = CountedPolicy(_policy({"a": 64}), counted.append)
    assert policy.choose([_w("a"), _w("b")], PROMPT).address == "a"
    assert policy.choose([], PROMPT) is None
    assert counted == [KV_HIT]


def test_the_pool_counts_only_the_tokens_a_worker_will_compute():
    registry = WorkerRegistry(StaticDiscovery(("a:1", "b:2"), ("c:3",)))
    try:
        for address in ("a:1", "b:2"):
            registry.report(PREFILL, address, common_pb2.WorkerLoad())
        pool = Pool(PREFILL, registry, SaturationPolicy(SaturationConfig()), _policy({"b:2": 96}),
                    AdmissionGate(10), 500, lambda pool, cls: None)
        slot = pool.acquire(Need("interactive", 0, 1.0, PROMPT * 8, num_prefill_tokens=136), Cancellation())
        assert slot.address == "b:2"
        assert {v.address: v.in_flight_tokens for v in registry.views(PREFILL)} == {"a:1": 0, "b:2": 40}
        slot.release()
        assert {v.in_flight_tokens for v in registry.views(PREFILL)} == {0}
    finally:
        registry.close()


def test_equal_loads_choose_device_over_host_over_store():
    workers = [_w("c"), _w("b"), _w("a")]
    device_vs_host = _policy({"a": 64}, store=64, host={"b": 64})
    placed = device_vs_host.place(workers, PROMPT)
    assert (placed.worker.address, placed.reason, placed.num_cached_tokens) == ("a", KV_HIT, 64)
    host_vs_store = _policy({}, store=64, host={"b": 64})  # c could import all 64 from the store
    placed = host_vs_store.place(workers, PROMPT)
    assert (placed.worker.address, placed.reason, placed.num_cached_tokens) == ("b", KV_HOST_HIT, 51)
    store_only = _policy({}, store=64)
    assert store_only.place(workers, PROMPT).reason == LEAST_LOADED  # the same to everyone: the first listed
    assert store_only.place(workers, PROMPT).worker.address == "c"


def test_a_loaded_device_hit_loses_to_an_idle_host_hit_when_the_saved_tokens_say_so():
    # a saves 1000 of prompt tokens, b 0.8 * 1000 = 800: the difference is worth 200 tokens of load
    policy = _policy({"a": 1000}, host={"b": 1000})
    busy = [_w("a", num_queued_prefill_tokens=300), _w("b")]  # 700 vs 800
    placed = policy.place(busy, PROMPT)
    assert (placed.worker.address, placed.reason, placed.num_cached_tokens) == ("b", KV_LOAD, 800)
    light = [_w("a", num_queued_prefill_tokens=100), _w("b")]  # 900 vs 800
    assert (policy.place(light, PROMPT).worker.address, policy.place(light, PROMPT).reason) == ("a", KV_HIT)


def test_saved_tokens_weigh_each_tier():
    # device 32, then host 32 at 0.8, then the store's 96 - 64 beyond them at 0.5
    assert kv_saved_tokens(32, 96, 0.5, host_tokens=32, host_weight=0.8) == 32 + 25.6 + 16
    assert kv_saved_tokens(32, 48, 0.5, host_tokens=32, host_weight=0.8) == 32 + 25.6  # the store holds less
    assert kv_saved_tokens(32, 96, 0.5) == 32 + 32  # no host tier: as before tiers


def test_tier_weights_are_configured_and_refused_out_of_range():
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.router.decide.config import RoutingConfig
    from pdserve.services.router.decide.placement import placement_policies
    from pdserve.services.router.decide.views import NoPrefixes
    cfg = RoutingConfig(kv_host_weight=0.9, kv_store_weight=0.25)
    policy = placement_policies(cfg, NoPrefixes(), colocated=False, count=lambda pool, reason: None)[PREFILL].policy
    assert (policy.host_weight, policy.store_weight) == (0.9, 0.25)
    for bad, field in ((dict(kv_host_weight=1.5), "kv_host_weight"), (dict(kv_host_weight=0.4), "kv_host_weight"),
                       (dict(kv_store_weight=0.9, kv_host_weight=0.8), "kv_host_weight"),
                       (dict(kv_store_weight=-0.1), "kv_store_weight")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            RouterConfig(**bad)


def test_tier_weights_are_router_flags():
    import argparse

    from pdserve.services.router import main as router_main
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    cfg = router_main.config_from_args(parser.parse_args(["--decode", "a:1", "--kv-host-weight", "0.6",
                                                          "--kv-store-weight", "0.2"]))
    assert (cfg.kv_host_weight, cfg.kv_store_weight) == (0.6, 0.2)
    with pytest.raises(ValueError, match="^kv_host_weight: "):
        router_main.config_from_args(parser.parse_args(["--decode", "a:1", "--kv-host-weight", "0.3"]))
