"""The chart's autoscaling metrics and dashboard against a real Prometheus.

The services of a `pdserve up --prefill 1 --decode 1` on the tiny model (in this process,
so the module starts in seconds; tests/cli/test_prometheus_config.py checks the config
for a real `pdserve up` plan) and one Debian `prometheus` (`make prometheus`) scraping
their /metrics every second, with the labels the chart's ServiceMonitor gives a cluster's
pods (tests/prometheus.py), on loopback, stopped by PID at the end. The benchmark client
sends load and records every request's TTFT and token gaps; then Prometheus is asked the
exact queries prometheus-adapter renders from the chart's rules (helm template, then
autoscale/adapter_query.py), with the chart's own quantile and window.

- Exact: each pool's answer equals histogram_quantile over the worker's own bucket
  counts (read from its /metrics). Prometheus scraped every worker before the first
  request, so the window's first sample of every bucket is 0: rate() then scales all
  buckets by one factor and the quantile is that of the raw counts.
- Against the client, within the buckets' resolution (rule below): the prefill pool's
  TTFT and the decode pool's ITL are the client's quantile of the same requests' TTFT,
  and of the gaps between the tokens the decode worker generated.
- Every PromQL expression of the Grafana dashboard runs on the same Prometheus.
- Queries written for vLLM (its `vllm:` names) return the workers' data.
"""
from __future__ import annotations

import bisect
import json
import re
import shutil
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.autoscale.adapter_query import parse_rules
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.targets import TargetConfig
from pdserve.services.common.metrics import LATENCY_BUCKETS
from tests.deploy.chart import CHART, FULLNAME, render, values
from tests.prometheus import LOCAL_NAMESPACE, PrometheusServer, ScrapeTarget, scrape_config, write_scrape_config
from tests.services.cluster import start_cluster

NUM_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 96, 12
POOL_SERIES = {"prefill": "pdserve_worker_ttft_seconds", "decode": "pdserve_worker_itl_seconds"}
PODS = {"prefill": "prefill-0", "decode": "decode-0"}
# Grafana's variables, as a dashboard on this Prometheus would fill them
GRAFANA_VARS = {"namespace": LOCAL_NAMESPACE, "__rate_interval": "1m", "__interval": "1s", "__range": "5m"}


@pytest.fixture(scope="module")
def cluster(tiny, tiny_llama_dir):
    """The services of a `pdserve up --prefill 1 --decode 1` in this process (fast: the
    weights are loaded once), each with its own /metrics port."""
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1, short_prompt_tokens=8)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def metrics_urls(cluster) -> dict[str, str]:
    """Pod name -> /metrics URL, named as `pdserve up` names its processes."""
    named = {**{f"prefill-{i}": w for i, w in enumerate(cluster.prefills)},
             **{f"decode-{i}": w for i, w in enumerate(cluster.decodes)}, "router": cluster.router}
    return {pod: f"http://127.0.0.1:{part.metrics_port}/metrics" for pod, part in named.items()}


@pytest.fixture(scope="module")
def prometheus(metrics_urls, tmp_path_factory):
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed (`make prometheus`: apt-get install -y prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    found = [ScrapeTarget(pod, pod.split("-")[0], url.removeprefix("http://").removesuffix("/metrics"))
             for pod, url in metrics_urls.items()]
    config = scrape_config(found, interval_s=1.0)
    server = PrometheusServer(write_scrape_config(str(tmp / "prometheus.yml"), config), str(tmp / "data"))
    with server:
        # every process scraped once before any request: the histograms' first samples are 0
        _wait(lambda: len(server.query("up == 1")) == len(found), 20, "every target up")
        yield server
    assert server.proc.poll() is not None


@pytest.fixture(scope="module")
def load(cluster, metrics_urls, prometheus):
    """The benchmark's run, and the time at which Prometheus holds all of it."""
    result = run_bench(BenchConfig(
        target=TargetConfig("grpc", cluster.router.address, timeout_s=120),
        dataset=DatasetConfig("random", num_requests=NUM_REQUESTS, input_len=LengthDist(PROMPT_TOKENS),
                              output_len=LengthDist(OUTPUT_TOKENS), seed=7),
        arrivals=ArrivalConfig("poisson", rate=40.0, max_concurrency=4, seed=7), progress=False), quiet=True)
    assert (result.summary["completed"], result.summary["failed"]) == (NUM_REQUESTS, 0), result.summary["errors"]
    for pool, series in POOL_SERIES.items():
        url = metrics_urls[PODS[pool]]
        _wait(lambda: _scraped_count(prometheus, series, PODS[pool]) == _count(url, series), 10,
              f"Prometheus has all of {PODS[pool]}'s {series}")
    return result, time.time()


@pytest.fixture(scope="module")
def rules():
    """The chart's adapter rules by pool, as helm renders them with the default values."""
    cm = render().get("ConfigMap", f"{FULLNAME}-adapter-rules")
    by_series = {r.series: r for r in parse_rules(cm["data"]["config.yaml"])}
    return {pool: by_series[f"{series}_bucket"] for pool, series in POOL_SERIES.items()}


@pytest.mark.parametrize("pool", POOL_SERIES)
def test_adapter_query_is_the_workers_histogram_quantile(pool, metrics_urls, prometheus, load, rules):
    _, at = load
    quantile = values()[pool]["autoscaling"]["metric"]["quantile"]
    got = _pod_values(prometheus, rules[pool].pod_query(LOCAL_NAMESPACE, [PODS[pool]]), at)
    buckets = _buckets(metrics_urls[PODS[pool]], POOL_SERIES[pool])
    assert got.keys() == {PODS[pool]}
    assert got[PODS[pool]] == pytest.approx(_histogram_quantile(quantile, buckets), rel=1e-9)


def test_adapter_quantiles_agree_with_the_benchmark_client(prometheus, load, rules):
    """Rule: the client's quantile (numpy, linear) lies in the bucket of Prometheus's
    interpolated value or in a neighbouring one. Prometheus only knows which bucket each
    observation fell in, and the client measures a little more than the worker does (the
    RPCs around it), which can carry a value across one bucket bound. The worker's TTFT
    starts when the request reaches it: the client's is taken less the time the router held
    it before calling a worker (the reply's timings.router_queue_s), which with four requests
    in flight on one prefill worker is the larger part of the difference, and varies with
    the machine's load."""
    result, at = load
    disaggregated = [r for r in result.records if r.path == "disaggregated"]
    assert len(disaggregated) == NUM_REQUESTS  # every prompt is over --short-prompt-tokens
    client = {
        "prefill": [r.ttft_s - r.timings["router_queue_s"] for r in disaggregated],
        # the first gap is the hand-off (KV read, joining the batch): the decode worker
        # counts the gaps between the tokens it generated, from its first one on
        "decode": [gap for r in disaggregated for gap in r.itl_s[1:]],
    }
    assert len(client["decode"]) == NUM_REQUESTS * (OUTPUT_TOKENS - 2)
    assert _scraped_count(prometheus, POOL_SERIES["decode"], PODS["decode"]) == len(client["decode"])
    assert _scraped_count(prometheus, POOL_SERIES["prefill"], PODS["prefill"]) == NUM_REQUESTS
    for pool, measured in client.items():
        quantile = values()[pool]["autoscaling"]["metric"]["quantile"]
        (served,) = _pod_values(prometheus, rules[pool].pod_query(LOCAL_NAMESPACE, [PODS[pool]]), at).values()
        expected = float(np.quantile(measured, quantile))
        assert abs(_bucket(expected) - _bucket(served)) <= 1, (pool, served, expected, LATENCY_BUCKETS)


def test_a_pod_that_served_nothing_reads_zero(prometheus, load, rules):
    """The rule's `or ... * 0` branch, and the adapter's multi-pod matcher (pod=~"a|b"):
    the prefill worker never times token gaps, so its ITL is 0, not missing."""
    _, at = load
    got = _pod_values(prometheus, rules["decode"].pod_query(LOCAL_NAMESPACE, ["decode-0", "prefill-0"]), at)
    assert got["prefill-0"] == 0.0 and got["decode-0"] > 0.0


def test_every_dashboard_query_runs(prometheus, load):
    exprs = _dashboard_exprs(json.loads((CHART / "dashboards" / "pdserve.json").read_text()))
    assert len(exprs) > 20
    results = {expr: prometheus.query(_fill_grafana_vars(expr)) for expr in exprs}  # PromQLError on a bad one
    # the panels of the two autoscaled metrics see the load
    for series, pod in (("pdserve_worker_ttft_seconds_bucket", "prefill-0"), ("pdserve_worker_itl_seconds_bucket",
                                                                               "decode-0")):
        (panel,) = [e for e in exprs if series in e]
        assert [r["metric"]["pod"] for r in results[panel] if r["value"][1] != "NaN"] == [pod], panel


def test_queries_written_for_vllm_return_data(cluster, metrics_urls, prometheus, load):
    """vLLM's names on the same Prometheus: a KEDA trigger's queue depth and a vLLM
    dashboard's TTFT quantile, unchanged. The prefill pool times the first tokens of these
    (all disaggregated) requests; the decode pool timed none, so its quantile is NaN."""
    _, at = load
    waiting = prometheus.query("sum(vllm:num_requests_waiting)", at)
    assert len(waiting) == 1 and float(waiting[0]["value"][1]) == 0.0  # the load is over
    by_model = prometheus.query("sum by (model_name) (vllm:num_requests_running)", at)
    assert [r["metric"]["model_name"] for r in by_model] == [cluster.router.servicer.model.served_name]
    quantiles = {r["metric"]["pod"]: float(r["value"][1]) for r in prometheus.query(
        "histogram_quantile(0.9, rate(vllm:time_to_first_token_seconds_bucket[1m]))", at)}
    assert set(quantiles) == {"prefill-0", "decode-0"} and np.isnan(quantiles["decode-0"])
    assert np.isfinite(quantiles["prefill-0"]) and quantiles["prefill-0"] > 0
    # the same observations as pdserve's own histogram, in vLLM's buckets
    buckets = _buckets(metrics_urls["prefill-0"], "vllm:time_to_first_token_seconds")
    assert quantiles["prefill-0"] == pytest.approx(_histogram_quantile(0.9, buckets), rel=1e-9)
    assert buckets[-1][1] == _count(metrics_urls["prefill-0"], POOL_SERIES["prefill"]) == NUM_REQUESTS
    (tokens,) = prometheus.query('sum(vllm:generation_tokens_total{pod="decode-0"})', at)
    assert float(tokens["value"][1]) == NUM_REQUESTS * (OUTPUT_TOKENS - 1)  # the first came from the prefill


# ---- helpers -----------------------------------------------------------------------

def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({timeout_s} s) waiting for: {what}")
        time.sleep(0.2)


def _samples(url: str, name: str) -> list:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def _count(url: str, series: str) -> float:
    (sample,) = _samples(url, f"{series}_count")
    return sample.value


def _buckets(url: str, series: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count), +Inf last."""
    return sorted((float(s.labels["le"]), s.value) for s in _samples(url, f"{series}_bucket"))


def _scraped_count(prometheus, series: str, pod: str) -> float:
    found = prometheus.query(f'{series}_count{{namespace="{LOCAL_NAMESPACE}",pod="{pod}"}}')
    return float(found[0]["value"][1]) if found else -1.0


def _pod_values(prometheus, query: str, at: float) -> dict[str, float]:
    return {r["metric"]["pod"]: float(r["value"][1]) for r in prometheus.query(query, at)}


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucketQuantile: the bucket where rank q*N falls, linear inside it
    (the first bucket starts at 0; a rank in +Inf gives the highest finite bound)."""
    total = buckets[-1][1]
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, below = (buckets[b - 1][0], buckets[b - 1][1]) if b > 0 else (0.0, 0.0)
    end, count = buckets[b]
    return start + (end - start) * (rank - below) / (count - below)


def _bucket(seconds: float) -> int:
    """The index of the bucket (le[i-1], le[i]] holding `seconds`."""
    return bisect.bisect_left(LATENCY_BUCKETS, seconds)


def _dashboard_exprs(node) -> list[str]:
    if isinstance(node, dict):
        return [e for k, v in node.items() for e in ([v] if k == "expr" else _dashboard_exprs(v))]
    if isinstance(node, list):
        return [e for v in node for e in _dashboard_exprs(v)]
    return []


def _fill_grafana_vars(expr: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in GRAFANA_VARS, f"the dashboard uses ${name}, unknown to this test: {expr}"
        return GRAFANA_VARS[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", fill, expr)
