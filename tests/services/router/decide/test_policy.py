"""The routing policies on WorkerView snapshots: no gRPC, no threads."""
from __future__ import annotations

import pytest

from pdserve.services.router.config import SaturationConfig
from pdserve.services.router.decide.policy import LeastQueuedPrefill, MostRoomDecode, PrefixAffinityPrefill, prefix_key
from pdserve.services.router.decide.saturation import SaturationPolicy
from pdserve.services.router.decide.views import WorkerView

PROMPT = list(range(40))


def _w(address: str, **load) -> WorkerView:
    return WorkerView(address, up=True, **load)


def test_least_queued_prefill_tokens():
    workers = [_w("a", num_queued_prefill_tokens=500), _w("b", num_queued_prefill_tokens=100),
               _w("c", num_queued_prefill_tokens=300)]
    assert LeastQueuedPrefill().choose(workers, PROMPT).address == "b"
    assert LeastQueuedPrefill().choose([], PROMPT) is None


def test_router_in_flight_tokens_count_before_the_next_poll():
    # b reported less, but this router has just sent it 900 tokens the report does not show yet
    workers = [_w("a", num_queued_prefill_tokens=500), _w("b", num_queued_prefill_tokens=100, in_flight_tokens=900)]
    assert LeastQueuedPrefill().choose(workers, PROMPT).address == "a"


def _affinity_pair(policy, workers):
    """Two prompts whose affinity workers differ."""
    by_worker = {}
    for start in range(0, 4000, 16):
        prompt = list(range(start, start + 40))
        by_worker.setdefault(policy.preferred(workers, prompt).address, prompt)
        if len(by_worker) == len(workers):
            return by_worker
    raise AssertionError("affinity never picked some worker")


def test_prefix_affinity_is_stable_and_spreads_prefixes():
    policy = PrefixAffinityPrefill(max_extra_tokens=1000)
    workers = [_w("a"), _w("b"), _w("c")]
    prompts = _affinity_pair(policy, workers)
    for address, prompt in prompts.items():
        assert policy.choose(workers, prompt).address == address
        # the same leading block with any continuation
        assert policy.choose(workers, prompt[:16] + [7] * 50).address == address
        # order of the listing does not matter
        assert policy.choose(list(reversed(workers)), prompt).address == address


def test_prefix_affinity_yields_to_the_least_loaded_when_overloaded():
    policy = PrefixAffinityPrefill(max_extra_tokens=1000)
    workers = [_w("a"), _w("b")]
    prompt = _affinity_pair(policy, workers)["a"]
    within = [_w("a", num_queued_prefill_tokens=1000), _w("b")]
    assert policy.choose(within, prompt).address == "a"
    beyond = [_w("a", num_queued_prefill_tokens=1001), _w("b")]
    assert policy.choose(beyond, prompt).address == "b"


def test_prefix_affinity_moves_when_its_worker_is_gone_and_comes_back():
    policy = PrefixAffinityPrefill(max_extra_tokens=1000)
    workers = [_w("a"), _w("b"), _w("c")]
    prompt = _affinity_pair(policy, workers)["a"]
    second = policy.choose([_w("b"), _w("c")], prompt).address
    assert second in ("b", "c")
    assert policy.choose([_w("c"), _w("b")], prompt).address == second  # stable second choice
    assert policy.choose(workers, prompt).address == "a"


def test_short_prompt_has_no_affinity():
    policy = PrefixAffinityPrefill(max_extra_tokens=1000)
    workers = [_w("a", num_queued_prefill_tokens=5), _w("b")]
    assert policy.preferred(workers, list(range(15))) is None
    assert policy.choose(workers, list(range(15))).address == "b"


def test_prefix_key_is_content_addressed():
    assert prefix_key([1, 2, 3]) == prefix_key([1, 2, 3]) != prefix_key([1, 2, 4])
    assert len(prefix_key(list(range(16)))) == 16


def test_decode_prefers_fewer_running_then_more_free_blocks():
    policy = MostRoomDecode()
    same_blocks = [_w("a", num_running=4, max_num_seqs=8, num_free_kv_blocks=50, num_total_kv_blocks=100),
                   _w("b", num_running=1, max_num_seqs=8, num_free_kv_blocks=50, num_total_kv_blocks=100)]
    assert policy.choose(same_blocks).address == "b"
    same_running = [_w("a", num_running=2, max_num_seqs=8, num_free_kv_blocks=90, num_total_kv_blocks=100),
                    _w("b", num_running=2, max_num_seqs=8, num_free_kv_blocks=10, num_total_kv_blocks=100)]
    assert policy.choose(same_running).address == "a"
    # the router's own outstanding requests count when the report is older
    fresh = [_w("a", in_flight=3, max_num_seqs=8, num_free_kv_blocks=90, num_total_kv_blocks=100),
             _w("b", num_running=1, max_num_seqs=8, num_free_kv_blocks=90, num_total_kv_blocks=100)]
    assert policy.choose(fresh).address == "b"
    assert policy.choose([]) is None


def test_decode_avoids_a_worker_busy_prefilling_long_prompts():
    # colocated: a has fewer streams but 2k prompt tokens still to prefill, which stall each of its steps
    policy = MostRoomDecode()
    busy = dict(max_num_seqs=64, num_free_kv_blocks=80, num_total_kv_blocks=100)
    workers = [_w("a", num_running=1, num_queued_prefill_tokens=2048, **busy), _w("b", num_running=3, **busy)]
    assert policy.choose(workers).address == "b"
    # the tokens this router just sent count before the worker reports them
    workers = [_w("a", num_running=1, in_flight_tokens=2048, **busy), _w("b", num_running=3, **busy)]
    assert policy.choose(workers).address == "b"
    workers = [_w("a", num_running=1, **busy), _w("b", num_running=3, **busy)]
    assert policy.choose(workers).address == "a"


@pytest.mark.parametrize("load,saturated", [
    (dict(), False),
    (dict(num_waiting=3), True),
    (dict(num_waiting=2), False),
    (dict(in_flight=4), True),
    (dict(num_queued_prefill_tokens=1000), True),
    (dict(in_flight_tokens=1000), True),
    (dict(num_free_kv_blocks=0, num_total_kv_blocks=100), True),
    (dict(num_free_kv_blocks=0, num_total_kv_blocks=0), False),  # not reported yet
    (dict(draining=True), True),
])
def test_saturation(load, saturated):
    policy = SaturationPolicy(SaturationConfig(max_waiting=3, max_queued_prefill_tokens=1000,
                                               min_free_kv_blocks=1, max_in_flight_per_worker=4))
    base = dict(num_free_kv_blocks=10, num_total_kv_blocks=100)
    assert policy.is_saturated(_w("a", **{**base, **load})) is saturated
