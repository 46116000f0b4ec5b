"""The per-pod metric read from the workers' /metrics, computed as the adapter rule's
histogram_quantile(rate(...[window])) would, and the controller that acts on it."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from pdserve.autoscale.controller import Autoscaler, PoolScaler, format_decision, pools_from_values
from pdserve.autoscale.pod_metrics import (MetricSpec, PodMetricSource, histogram_quantile, metric_specs,
                                           parse_duration)
from pdserve.services.worker.metrics import WorkerMetrics

VALUES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve" / "values.yaml"
SPEC = MetricSpec("pdserve_worker_ttft_seconds", 0.9, 10.0)


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 10.0), (0.5, 20.0), (1.0, 20.0), (math.inf, 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)   # rank 10: the top of the first bucket
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.3)  # rank 15: halfway through (0.1, 0.5]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert histogram_quantile(0.9, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile(0.9, [(1.0, 0.0), (math.inf, 0.0)]))


class Worker:
    """A worker's real metrics registry, served as its /metrics text."""

    def __init__(self):
        self.metrics = WorkerMetrics("prefill")

    def text(self) -> str:
        return generate_latest(self.metrics.metrics.registry).decode()


def test_the_quantile_covers_only_the_window_and_an_idle_pod_reads_zero():
    w = Worker()
    source = PodMetricSource(SPEC, fetch_text=lambda url: w.text())
    for _ in range(100):
        w.metrics.ttft.observe(4.0)  # an old, slow burst
    assert source.observe(0.0, ["a"]) == {}  # one scrape: no rate yet
    for _ in range(10):
        w.metrics.ttft.observe(0.2)
    # only the 10 new ones, all in (0.1, 0.25]: rank 9 of 10 -> 0.1 + 0.15 * 0.9
    assert source.observe(5.0, ["a"])["a"] == pytest.approx(0.235)
    assert source.observe(14.0, ["a"])["a"] == 0.0  # nothing new since t=5 (t=0 left the window)


def test_a_restarted_worker_counts_from_zero():
    workers = [Worker()]
    source = PodMetricSource(SPEC, fetch_text=lambda url: workers[0].text())
    for _ in range(50):
        workers[0].metrics.ttft.observe(4.0)
    source.observe(0.0, ["a"])
    workers[0] = Worker()  # counters back at 0
    for _ in range(5):
        workers[0].metrics.ttft.observe(0.03)
    assert source.observe(2.0, ["a"])["a"] == pytest.approx(0.05, abs=0.02)


def test_an_unreachable_pod_has_no_value():
    def fetch(url):
        raise ConnectionRefusedError(url)
    assert PodMetricSource(SPEC, fetch_text=fetch).observe(0.0, ["a"]) == {}


def test_metric_specs_read_the_charts_window_and_quantile():
    values = yaml.safe_load(VALUES.read_text())
    specs = metric_specs(values)
    assert specs["prefill"] == MetricSpec("pdserve_worker_ttft_seconds", values["prefill"]["autoscaling"]["metric"]
                                          ["quantile"], parse_duration(values["prefill"]["autoscaling"]["metric"]
                                                                       ["window"]))
    assert specs["decode"].histogram == "pdserve_worker_itl_seconds"
    assert parse_duration("2m") == 120 and parse_duration("1h") == 3600
    values["decode"]["autoscaling"]["metric"]["window"] = "2 minutes"
    with pytest.raises(ValueError, match=r"decode\.autoscaling\.metric\.window"):
        metric_specs(values)


class FakePools(PoolScaler):
    def __init__(self, workers: dict[str, Worker]):
        self.workers, self.sizes = workers, {"prefill": len(workers), "decode": 1}

    def replicas(self, pool):
        return self.sizes[pool]

    def metrics_urls(self, pool):
        return list(self.workers) if pool == "prefill" else []

    def scale(self, pool, replicas):
        self.sizes[pool] = replicas


def test_the_controller_scales_a_pool_over_target_and_logs_each_decision():
    values = yaml.safe_load(VALUES.read_text())
    values["prefill"]["autoscaling"]["metric"].update(window="10s", targetSeconds=0.5)
    w = Worker()
    pools = FakePools({"http://w/metrics": w})
    clock = [0.0]
    lines = []
    ctl = Autoscaler(pools_from_values(values), pools, sync_period_s=2.0, log=lines.append,
                     clock=lambda: clock[0], fetch_text=lambda url: w.text())
    ctl.tick()
    for _ in range(20):
        w.metrics.ttft.observe(2.0)  # TTFT 4x the target
    clock[0] = 1.0
    ctl.tick()  # not a sync yet
    assert len(lines) == 2  # the first sync: both pools
    clock[0] = 2.0
    ctl.tick()
    assert pools.sizes["prefill"] == 3  # q0.9 of (1, 2.5] = 2.35: ceil(4.7) = 5, limited by Pods=2/60s
    line = [x for x in lines if "pool=prefill" in x][-1]
    assert "current=1" in line and "desired=3" in line and "raw=5" in line and "Pods=2/60s" in line
    assert line == format_decision("prefill", ctl.decisions[-2][1], 0.5)
    assert "pool=decode current=1 metric=none" in lines[-1]
