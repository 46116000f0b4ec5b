"""The vllm: families a worker exports beside pdserve's: vLLM's names, types, labels and
buckets, fed by the same observations and the engine's cumulative stats."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.stats import EngineStats, HostTierStats
from pdserve.services.worker.metrics import WorkerMetrics
from pdserve.services.worker.vllm_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

LABELS = {"model_name": "tiny-chat", "engine": "0"}
# family -> type, as vLLM's /metrics declares them (counters: the family name has no _total)
FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:external_prefix_cache_queries": "counter", "vllm:external_prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
}
BUCKETS = {"vllm:time_to_first_token_seconds": TTFT_BUCKETS, "vllm:inter_token_latency_seconds": ITL_BUCKETS,
           "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
           "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS}


@pytest.fixture
def metrics() -> WorkerMetrics:
    return WorkerMetrics("decode", "tiny-chat")


def _families(m: WorkerMetrics) -> dict:
    text = generate_latest(m.metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)
            if f.name.startswith("vllm:") and not f.name.endswith("_created")}  # (prometheus_client's own)


def _value(m: WorkerMetrics, sample: str, **labels) -> float:
    return m.metrics.registry.get_sample_value(sample, {**LABELS, **labels})


def test_vllm_s_families_types_and_labels(metrics):
    families = _families(metrics)
    assert {name: f.type for name, f in families.items()} == FAMILIES
    for family in families.values():
        for s in family.samples:
            assert {k: v for k, v in s.labels.items() if k not in ("le", "finished_reason")} == LABELS, s
    assert "vllm:prompt_tokens_total" in {s.name for s in families["vllm:prompt_tokens"].samples}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort"}  # each there from the start, at 0


@pytest.mark.parametrize("name", BUCKETS)
def test_vllm_s_bucket_boundaries(metrics, name):
    bounds = [float(s.labels["le"]) for s in _families(metrics)[name].samples if s.name.endswith("_bucket")]
    assert bounds == [*BUCKETS[name], float("inf")]


def test_vllm_s_bucket_lists_are_vllm_s():
    assert (len(TTFT_BUCKETS), TTFT_BUCKETS[0], TTFT_BUCKETS[-1]) == (22, 0.001, 2560.0)
    assert (len(ITL_BUCKETS), ITL_BUCKETS[0], ITL_BUCKETS[-1]) == (19, 0.01, 80.0)
    assert (len(REQUEST_LATENCY_BUCKETS), REQUEST_LATENCY_BUCKETS[0], REQUEST_LATENCY_BUCKETS[-1]) == (21, 0.3, 7680.0)


def test_engine_stats_become_gauges_and_counter_increases(metrics):
    metrics.update(EngineStats(num_running=3, num_waiting=2, num_free_kv_blocks=30, num_total_kv_blocks=40,
                               num_preemptions=1, num_prefix_queried_tokens=100, num_prefix_hit_tokens=64))
    metrics.update(EngineStats(num_running=1, num_waiting=0, num_free_kv_blocks=10, num_total_kv_blocks=40,
                               num_preemptions=4, num_prefix_queried_tokens=160, num_prefix_hit_tokens=96))
    assert (_value(metrics, "vllm:num_requests_running"), _value(metrics, "vllm:num_requests_waiting")) == (1, 0)
    assert _value(metrics, "vllm:kv_cache_usage_perc") == 0.75  # 30 of 40 blocks in use
    assert _value(metrics, "vllm:num_preemptions_total") == 4
    assert _value(metrics, "vllm:prefix_cache_queries_total") == 160
    assert _value(metrics, "vllm:prefix_cache_hits_total") == 96
    # pdserve's own families of the same two facts
    assert metrics.metrics.value("kv_cache_usage_ratio") == 0.75
    assert metrics.metrics.value("worker_preemptions_total") == 4


def test_the_host_tier_s_stats_in_both_families(metrics):
    """vLLM counts a KV connector's hits (its CPU offloading's too) as external prefix-cache
    hits: here the host tier's, of the tokens the device missed."""
    assert metrics.metrics.value("kv_host_copied_blocks_total", {"direction": "onload"}) == 0  # there from the start
    metrics.update(EngineStats(host=HostTierStats(num_queried_tokens=80, num_hit_tokens=32, num_offloaded_blocks=5,
                                                  num_onloaded_blocks=2, num_used_blocks=5, num_total_blocks=64)))
    metrics.update(EngineStats(host=HostTierStats(num_queried_tokens=200, num_hit_tokens=96, num_offloaded_blocks=9,
                                                  num_onloaded_blocks=6, num_used_blocks=9, num_total_blocks=64)))
    assert _value(metrics, "vllm:external_prefix_cache_queries_total") == 200
    assert _value(metrics, "vllm:external_prefix_cache_hits_total") == 96
    m = metrics.metrics
    assert (m.value("prefix_cache_host_queried_tokens"), m.value("prefix_cache_host_hit_tokens")) == (200, 96)
    assert m.value("kv_host_copied_blocks_total", {"direction": "offload"}) == 9
    assert m.value("kv_host_copied_blocks_total", {"direction": "onload"}) == 6
    assert (m.value("kv_host_blocks_used"), m.value("kv_host_blocks_capacity")) == (9, 64)


def test_kv_usage_of_an_engine_not_sized_yet_is_zero():
    assert EngineStats().kv_cache_usage == 0.0


def test_one_request_feeds_both_families(metrics):
    metrics.first_token(0.03)
    for gap in (0.02, 0.2):
        metrics.token_gap(gap)
    metrics.prompt_computed(12)
    metrics.tokens_generated(3)
    metrics.request_done(1.2, 0.004, "stop")
    assert _value(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert _value(metrics, "vllm:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert _value(metrics, "vllm:inter_token_latency_seconds_count") == 2
    assert _value(metrics, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 1
    assert (_value(metrics, "vllm:prompt_tokens_total"), _value(metrics, "vllm:generation_tokens_total")) == (12, 3)
    assert _value(metrics, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.2)
    assert _value(metrics, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.004)
    assert _value(metrics, "vllm:request_success_total", finished_reason="stop") == 1
    # pdserve's own: the same observations
    assert metrics.metrics.value("worker_ttft_seconds_count") == 1
    assert metrics.metrics.value("worker_itl_seconds_count") == 2
    assert metrics.metrics.value("prefill_tokens_total") == 12 and metrics.metrics.value("decode_tokens_total") == 3
    assert metrics.metrics.value("worker_requests_total", {"outcome": "ok"}) == 1


def test_a_hand_off_is_not_a_finish_and_an_abort_is_one(metrics):
    metrics.request_done(0.5, 0.0, "handoff")  # a prefill worker's: its decode counts the finish
    metrics.request_aborted()
    success = {r: _value(metrics, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")}
    assert success == {"stop": 0, "length": 0, "abort": 1}
    assert _value(metrics, "vllm:e2e_request_latency_seconds_count") == 1  # the prefill's own part is timed
    assert metrics.metrics.value("worker_requests_total", {"outcome": "aborted"}) == 1
