"""NetworkPolicy, evaluated: who can open a connection to which port of which pod.

The evaluator follows the NetworkPolicy semantics for what the chart uses (podSelector and
namespaceSelector matchLabels, ipBlock, named ports): a pod selected by no policy takes
everything; a selected pod takes what one of its policies' ingress rules allows."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pytest

from tests.deploy.chart import FULLNAME, NAMESPACE, RELEASE, VALUES, render

BASE = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/instance": RELEASE}


@dataclass(frozen=True)
class Source:
    labels: dict = field(default_factory=dict)
    namespace: str = NAMESPACE
    namespace_labels: dict = field(default_factory=dict)
    ip: str = "192.0.2.10"


def component(name: str, release: str = RELEASE) -> Source:
    return Source({**BASE, "app.kubernetes.io/instance": release, "app.kubernetes.io/component": name},
                  namespace_labels={"kubernetes.io/metadata.name": NAMESPACE}, ip="10.1.2.3")


OUTSIDE = Source(namespace="", ip="203.0.113.7")                   # a client outside the cluster
OTHER_APP = Source({"app": "other"}, namespace="apps", namespace_labels={"kubernetes.io/metadata.name": "apps"},
                   ip="10.9.9.9")                                  # another team's pod
NEIGHBOUR = Source({"app": "other"}, namespace_labels={"kubernetes.io/metadata.name": NAMESPACE},
                   ip="10.1.9.9")                                  # not ours, same namespace
PROMETHEUS = Source({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring",
                    namespace_labels={"kubernetes.io/metadata.name": "monitoring"}, ip="10.2.0.5")


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"evaluator handles matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, src: Source) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(src.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if not src.namespace:  # not a pod: only ipBlocks can name it
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], src.namespace_labels):
            return False
    elif src.namespace != NAMESPACE:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], src.labels)


def _port_matches(rule_ports, port_name: str, port_number: int) -> bool:
    return not rule_ports or any(p["port"] in (port_name, port_number) for p in rule_ports)


class Cluster:
    def __init__(self, manifests):
        self.policies = manifests.of_kind("NetworkPolicy")
        self.pods = {meta["labels"]["app.kubernetes.io/component"]: (meta["labels"], spec)
                     for _, meta, spec in manifests.pod_specs() if not spec.get("restartPolicy") == "Never"}

    def can_reach(self, src: Source, target: str, port_name: str) -> bool:
        labels, spec = self.pods[target]
        ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
        assert port_name in ports, f"{target} has no port {port_name}"
        selecting = [p for p in self.policies if _selects(p["spec"]["podSelector"], labels)]
        if not selecting:
            return True
        return any(_port_matches(rule.get("ports"), port_name, ports[port_name])
                   and (not rule.get("from") or any(_peer_matches(peer, src) for peer in rule["from"]))
                   for p in selecting for rule in p["spec"].get("ingress", []))


@pytest.mark.parametrize("name", list(VALUES))
def test_every_pod_of_the_release_is_guarded(name):
    cluster = Cluster(render(name))
    for target, (labels, _) in cluster.pods.items():
        selecting = [p for p in cluster.policies if _selects(p["spec"]["podSelector"], labels)]
        assert len(selecting) == 1, f"{target}: {len(selecting)} policies"
        assert selecting[0]["spec"]["policyTypes"] == ["Ingress"]


@pytest.mark.parametrize("name", ["default", "cpu", "redis", "no-autoscaling"])
def test_only_the_router_is_reachable_from_outside_the_release(name):
    c = Cluster(render(name))
    strangers = (OUTSIDE, OTHER_APP, NEIGHBOUR, component("router", release="other-release"))
    for src in strangers:
        assert c.can_reach(src, "router", "grpc") and c.can_reach(src, "router", "http")
        for target in ("prefill", "decode", "kvstore"):
            assert not c.can_reach(src, target, "grpc"), (src, target)
            assert not c.can_reach(src, target, "metrics"), (src, target)
    if "redis" in c.pods:
        assert not any(c.can_reach(src, "redis", "redis") for src in strangers)


@pytest.mark.parametrize("name", list(VALUES))
def test_inside_the_release_each_hop_is_allowed_and_nothing_else(name):
    c = Cluster(render(name))
    allowed = {("router", "prefill"), ("router", "decode"), ("prefill", "kvstore"), ("decode", "kvstore"),
               ("router", "kvstore")}  # the router releases leases of cancelled requests
    for src in ("router", "prefill", "decode", "kvstore"):
        for target in ("prefill", "decode", "kvstore"):
            if src != target:
                assert c.can_reach(component(src), target, "grpc") == ((src, target) in allowed), (src, target)
    if "redis" in c.pods:
        for src in ("router", "prefill", "decode", "kvstore"):
            assert c.can_reach(component(src), "redis", "redis") == (src == "kvstore"), src


@pytest.mark.parametrize("name", list(VALUES))
def test_prometheus_scrapes_the_metrics_port_and_nothing_more(name):
    c = Cluster(render(name))
    for target in ("router", "prefill", "decode", "kvstore"):
        assert c.can_reach(PROMETHEUS, target, "metrics"), target
    for target in ("prefill", "decode", "kvstore"):
        assert not c.can_reach(PROMETHEUS, target, "grpc"), target


def test_a_narrowed_router_takes_only_its_sources_and_the_release_test_pod():
    c = Cluster(render("large"))
    assert c.can_reach(Source(namespace="", ip="10.20.30.40"), "router", "grpc")      # inside 10.0.0.0/8
    assert not c.can_reach(OUTSIDE, "router", "grpc")
    gateway = Source({"app": "envoy"}, namespace="gateway", namespace_labels={"kubernetes.io/metadata.name": "gateway"},
                     ip="172.16.0.9")
    assert c.can_reach(gateway, "router", "http")
    assert c.can_reach(component("test"), "router", "grpc")  # `helm test`
    # its metricsFrom names Prometheus's pods, not the whole monitoring namespace
    assert c.can_reach(PROMETHEUS, "decode", "metrics")
    grafana = Source({"app.kubernetes.io/name": "grafana"}, namespace="monitoring",
                     namespace_labels={"kubernetes.io/metadata.name": "monitoring"})
    assert not c.can_reach(grafana, "decode", "metrics")


def test_no_network_policy_when_disabled():
    m = render("default", sets=("networkPolicy.enabled=false",))
    assert not m.of_kind("NetworkPolicy")
    assert m.get("Deployment", f"{FULLNAME}-router")  # the rest renders as before
