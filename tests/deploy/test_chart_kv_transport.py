"""kvstore.transport=ucx, tcp (auto, the default) or grpc: the kvstore listens on UCX (or raw TCP frames) with its
container, Service and NetworkPolicy ports, every worker moves KV over it, and the command
lines are what `pdserve` accepts."""
from __future__ import annotations

from tests.deploy.chart import FULLNAME, container, port_number, render
from tests.deploy.test_chart_pods import deployment, parse

UCX = ("kvstore.transport=ucx", "kvstore.ucxPort=50071", "networkPolicy.enabled=true")


def test_ucx_is_served_and_used_end_to_end():
    m = render(sets=UCX)
    kvstore = container(deployment(m, "kvstore"))
    assert parse(kvstore).ucx_port == 50071 and port_number(kvstore, "ucx") == 50071
    service = m.get("Service", f"{FULLNAME}-kvstore")
    assert {"name": "ucx", "port": 50071, "targetPort": "ucx", "protocol": "TCP"} in service["spec"]["ports"]
    policy = m.get("NetworkPolicy", f"{FULLNAME}-kvstore")
    assert {"port": "ucx", "protocol": "TCP"} in policy["spec"]["ingress"][0]["ports"]
    for pool in ("prefill", "decode"):
        assert parse(container(deployment(m, pool))).kvstore_transport == "ucx"


def test_tcp_is_served_and_used_end_to_end():
    m = render(sets=("kvstore.transport=tcp", "kvstore.tcpPort=50072", "networkPolicy.enabled=true"))
    kvstore = container(deployment(m, "kvstore"))
    assert parse(kvstore).tcp_port == 50072 and port_number(kvstore, "kv-tcp") == 50072
    assert parse(kvstore).ucx_port is None
    service = m.get("Service", f"{FULLNAME}-kvstore")
    assert {"name": "kv-tcp", "port": 50072, "targetPort": "kv-tcp", "protocol": "TCP"} in service["spec"]["ports"]
    policy = m.get("NetworkPolicy", f"{FULLNAME}-kvstore")
    assert {"port": "kv-tcp", "protocol": "TCP"} in policy["spec"]["ingress"][0]["ports"]
    for pool in ("prefill", "decode"):
        assert parse(container(deployment(m, pool))).kvstore_transport == "tcp"


def test_tcp_by_default():
    m = render()
    kvstore = container(deployment(m, "kvstore"))
    assert parse(kvstore).tcp_port == 50062 and parse(kvstore).ucx_port is None
    assert "kv-tcp" in [p["name"] for p in m.get("Service", f"{FULLNAME}-kvstore")["spec"]["ports"]]
    for pool in ("prefill", "decode"):
        assert parse(container(deployment(m, pool))).kvstore_transport == "tcp"


def test_grpc_opens_no_block_port():
    m = render(sets=("kvstore.transport=grpc", "networkPolicy.enabled=true"))
    kvstore = container(deployment(m, "kvstore"))
    assert parse(kvstore).ucx_port is None and parse(kvstore).tcp_port is None
    assert [p["name"] for p in m.get("Service", f"{FULLNAME}-kvstore")["spec"]["ports"]] == ["grpc", "metrics"]
    policy = m.get("NetworkPolicy", f"{FULLNAME}-kvstore")
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    for pool in ("prefill", "decode"):
        assert parse(container(deployment(m, pool))).kvstore_transport == "grpc"
