"""Autoscaling and observability wiring: each HPA scales its own pool's Deployment on a
per-pod metric that an adapter rule derives from a histogram the workers really export;
the ServiceMonitor scrapes every component; the dashboard asks only for real metrics."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from pdserve.services.worker.metrics import WorkerMetrics
from pdserve.services.kvstore.kv_metrics import KVStoreMetrics
from pdserve.services.kvstore.stores.base import StoreStats
from pdserve.services.router.config import default_slo_classes
from pdserve.services.router.metrics import RouterMetrics
from tests.deploy.chart import COMPONENTS, FULLNAME, VALUES, render, values

# What each pool scales on: the worker histogram behind its HPA metric.
POOL_SERIES = {"prefill": "pdserve_worker_ttft_seconds", "decode": "pdserve_worker_itl_seconds"}
AUTOSCALED = [n for n in VALUES if values(n)["prefill"]["autoscaling"]["enabled"]]


def exported_series() -> dict[str, str]:
    """Every sample name the services export -> its metric type, from their own registries."""
    kv = KVStoreMetrics()
    kv.watch(lambda: StoreStats(1, 0, 0, 0, 0, 0, 0, 0))
    registries = [WorkerMetrics("prefill").metrics.registry, RouterMetrics(default_slo_classes()).metrics.registry,
                  kv.metrics.registry]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + s: family.type for r in registries for family in r.collect()
            for s in suffixes[family.type]}


SERIES = exported_series()


def adapter_rules(m) -> list[dict]:
    return yaml.safe_load(m.get("ConfigMap", f"{FULLNAME}-adapter-rules")["data"]["config.yaml"])["rules"]


@pytest.mark.parametrize("name", AUTOSCALED)
@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_each_pool_hpa_scales_its_own_deployment_on_its_latency(name, pool):
    m, v = render(name), values(name)[pool]["autoscaling"]
    hpa = m.get("HorizontalPodAutoscaler", f"{FULLNAME}-{pool}")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", f"{FULLNAME}-{pool}")
    assert "replicas" not in m.get("Deployment", target["name"])["spec"]  # the HPA owns the count
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (v["minReplicas"], v["maxReplicas"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == v["metric"]["name"]
    target_value = metric["pods"]["target"]
    assert target_value["type"] == "AverageValue"
    assert target_value["averageValue"] == f"{round(v['metric']['targetSeconds'] * 1000)}m"
    assert hpa["spec"]["behavior"] == v["behavior"]
    # the adapter rule that serves this metric derives it from this pool's histogram
    (rule,) = [r for r in adapter_rules(m) if r["name"]["as"] == v["metric"]["name"]]
    assert rule["seriesQuery"].startswith(POOL_SERIES[pool] + "_bucket{")
    assert f"histogram_quantile({v['metric']['quantile']}," in rule["metricsQuery"]
    assert f"[{v['metric']['window']}]" in rule["metricsQuery"]


def test_the_hpas_differ_prefill_on_ttft_and_decode_on_itl():
    m = render("default")
    hpas = {pool: m.get("HorizontalPodAutoscaler", f"{FULLNAME}-{pool}") for pool in ("prefill", "decode")}
    names = {pool: hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] for pool, hpa in hpas.items()}
    rules = {r["name"]["as"]: r["seriesQuery"] for r in adapter_rules(m)}
    assert "ttft" in rules[names["prefill"]] and "itl" in rules[names["decode"]]
    assert len(m.of_kind("HorizontalPodAutoscaler")) == 2  # the router and the kvstore do not autoscale


@pytest.mark.parametrize("name", AUTOSCALED)
def test_adapter_rules_read_histograms_the_workers_export_per_pod(name):
    for rule in adapter_rules(render(name)):
        base = rule["seriesQuery"].split("{")[0]
        assert SERIES.get(base) == "histogram", f"{base} is not a histogram the services export"
        count = base.removesuffix("_bucket") + "_count"
        assert count in SERIES and count in rule["metricsQuery"]
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        # per pod: the adapter fills in the pods the HPA asks about and groups by pod
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        assert re.fullmatch(rf"\^{base}\$", rule["name"]["matches"])


def test_without_autoscaling_the_deployments_carry_their_replicas():
    m = render("no-autoscaling")
    assert not m.of_kind("HorizontalPodAutoscaler")
    assert m.find("ConfigMap", f"{FULLNAME}-adapter-rules") is None
    for pool in ("prefill", "decode"):
        replicas = m.get("Deployment", f"{FULLNAME}-{pool}")["spec"]["replicas"]
        assert replicas == values("no-autoscaling")[pool]["replicas"]


def test_adapter_rules_can_live_in_the_adapters_namespace():
    assert render("large").get("ConfigMap", f"{FULLNAME}-adapter-rules")["metadata"]["namespace"] == "monitoring"


def test_the_service_monitor_scrapes_every_component_metrics_port():
    m = render("large")
    (monitor,) = m.of_kind("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    selector = monitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    for service in m.of_kind("Service"):
        labels = service["metadata"]["labels"]
        selected = (selector["matchLabels"].items() <= labels.items()
                    and labels["app.kubernetes.io/component"] in expression["values"])
        has_metrics = any(p["name"] == "metrics" for p in service["spec"]["ports"])
        assert selected == has_metrics, service["metadata"]["name"]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in m.of_kind("Service")
            if any(p["name"] == "metrics" for p in s["spec"]["ports"])} == set(COMPONENTS)
    assert not render("default").of_kind("ServiceMonitor")  # a toggle, off by default (needs the CRD)


def test_the_dashboard_charts_only_metrics_the_services_export():
    m = render("large")
    config_map = m.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["pdserve.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bpdserve_[a-z_]+", e)}
    assert used and not used - set(SERIES), f"not exported: {sorted(used - set(SERIES))}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("ttft", "itl", "queue", "kv cache usage", "kvstore traffic"):
        assert topic in titles, topic
    assert not render("default").find("ConfigMap", f"{FULLNAME}-dashboard")
