"""`pdserve bench serve --worker-metrics`: speculative decoding over the run, from the
workers' counters before and after it, against a real router and an n-gram decode worker."""
from __future__ import annotations

import pytest

from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.main import BenchConfig, add_arguments, config_from_args, run_bench
from pdserve.cli.bench.report import table
from pdserve.cli.bench.targets import TargetConfig
from pdserve.cli.bench.worker_metrics import SpecCounts, metrics_url, scrape_spec, spec_summary
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.services.decode.server import serve as serve_decode
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.router.server import serve as serve_router
from pdserve.services.worker.config import WorkerConfig


def test_the_run_is_the_counters_increase():
    s = spec_summary(SpecCounts(10, 4, 5), SpecCounts(50, 34, 15))
    assert s == {"proposed_tokens": 40, "accepted_tokens": 30, "verifications": 10,
                 "acceptance_rate": 0.75, "mean_accepted_length": 3.0}
    assert spec_summary(SpecCounts(), SpecCounts())["acceptance_rate"] is None  # nothing drafted: no rate


def test_urls_are_completed_and_a_bad_one_is_named():
    assert metrics_url("127.0.0.1:9100") == "http://127.0.0.1:9100/metrics"
    assert metrics_url("http://h:1/metrics") == "http://h:1/metrics"
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--worker-metrics", "a:1, b:2"])).worker_metrics == (
        "http://a:1/metrics", "http://b:2/metrics")
    with pytest.raises(ValueError, match="--worker-metrics: cannot read http://127.0.0.1:1/metrics"):
        scrape_spec(("http://127.0.0.1:1/metrics",))


@pytest.fixture(scope="module")
def ngram_platform(tiny, tiny_llama_dir):
    engine = EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_cache_memory_bytes=8 << 20),
                          speculative_config=SpeculativeConfig("ngram", 4))
    decode = serve_decode(WorkerConfig(engine=engine, metrics_port=0), tiny)
    router = serve_router(RouterConfig(model=tiny_llama_dir, decode_addresses=(decode.address,),
                                       paths=PathConfig(policy="colocated"), port=0, metrics_port=None))
    yield router, decode
    router.stop()
    decode.stop()


def test_the_report_shows_what_the_workers_counted(ngram_platform, capsys):
    router, decode = ngram_platform
    url = f"http://127.0.0.1:{decode.metrics_port}/metrics"
    before = decode.loop.stats
    result = run_bench(BenchConfig(
        target=TargetConfig("grpc", router.address, timeout_s=120),
        dataset=DatasetConfig("random", num_requests=3, input_len=LengthDist(24), output_len=LengthDist(16), seed=3),
        progress=False, plots=False, worker_metrics=(url,)))
    assert result.summary["failed"] == 0, result.summary["errors"]
    spec, after = result.summary["spec_decode"], decode.loop.stats
    assert spec["proposed_tokens"] == after.num_spec_proposed_tokens - before.num_spec_proposed_tokens > 0
    assert spec["accepted_tokens"] == after.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    assert spec["verifications"] == after.num_spec_verifications - before.num_spec_verifications > 0
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["proposed_tokens"]
    printed = capsys.readouterr().out
    assert f"{spec['accepted_tokens']} / {spec['proposed_tokens']}" in printed
    assert "Spec decode: acceptance rate" in printed


def test_without_worker_metrics_the_report_has_no_spec_rows(ngram_platform):
    router, _ = ngram_platform
    result = run_bench(BenchConfig(
        target=TargetConfig("grpc", router.address, timeout_s=120),
        dataset=DatasetConfig("random", num_requests=1, input_len=LengthDist(8), output_len=LengthDist(2)),
        progress=False, plots=False), quiet=True)
    assert "spec_decode" not in result.summary and "Spec decode" not in table(result.summary)


def test_the_router_decisions_of_a_run_by_path_and_reason():
    """bench/serve_goodput.py's reasons: the router's counter scraped over HTTP before and
    after a run, the run's increase per path/reason, the unused ones left out."""
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    from pdserve.cli.bench.local_platform import free_port
    from pdserve.cli.bench.worker_metrics import decisions_during, scrape_path_decisions
    registry = CollectorRegistry()
    decisions = Counter("pdserve_router_path_decisions", "by path and reason", ("path", "reason"), registry=registry)
    decisions.labels("direct", "fits_itl_budget").inc(3)
    decisions.labels("disaggregated", "prefill_pool").inc(1)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        before = scrape_path_decisions(url)
        assert before == {"direct/fits_itl_budget": 3.0, "disaggregated/prefill_pool": 1.0}
        decisions.labels("direct", "prefill_pool_misses_ttft").inc(2)
        decisions.labels("direct", "fits_itl_budget").inc(1)
        assert decisions_during(before, scrape_path_decisions(url)) == {
            "direct/fits_itl_budget": 1, "direct/prefill_pool_misses_ttft": 2}
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="cannot read the router's metrics at http://127.0.0.1:1/metrics"):
        scrape_path_decisions("http://127.0.0.1:1/metrics")
