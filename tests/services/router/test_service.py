"""The router as a service: health, reflection, /metrics, config and the CLI."""
from __future__ import annotations

import argparse
import json
import re
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine import SamplingParams
from pdserve.services.common.grpc_server import channel, is_serving
from pdserve.services.router import main as router_main
from pdserve.services.router.client import RouterClient
from pdserve.services.router.config import RouterConfig, SLOClass, load_slo_classes
from pdserve.services.router.state.discovery import StaticDiscovery, parse_addresses
from tests.services.router.fakes import address_of

LONG = list(range(200, 260))


def test_health_serving_and_reflection_lists_the_router(cluster):
    assert is_serving(cluster.router.address)
    with channel(cluster.router.address) as ch:
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"pdserve.v1.Router", "grpc.health.v1.Health"} <= names


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_endpoint_shows_latency_histograms_moving(cluster, client):
    by = dict(slo_class="batch", path="disaggregated")
    before = _scrape(cluster.router.metrics_port)
    for _ in range(2):
        list(client.generate(LONG, SamplingParams(max_tokens=5), slo_class="batch", timeout_s=30))
    after = _scrape(cluster.router.metrics_port)
    for name, added in (("ttft", 2), ("itl", 2 * 4)):  # per request: one first token, four gaps after it
        count = f"pdserve_router_{name}_seconds_count"
        assert _sample(after, count, **by) == _sample(before, count, **by) + added
    assert _sample(after, "pdserve_router_ttft_seconds_sum", **by) > 0
    for name in ("pdserve_router_e2e_seconds_count", "pdserve_router_queue_seconds_count"):
        assert _sample(after, name, **by) == 2
    assert _sample(after, "pdserve_router_requests_total", slo_class="batch", outcome="ok") == 2
    assert _sample(after, "pdserve_router_workers_up", pool="decode") == 2
    assert _sample(after, "pdserve_router_slo_target_seconds", slo_class="interactive", kind="ttft") == 1.0
    assert re.search(r'pdserve_router_ttft_seconds_bucket\{le="0.005",path="disaggregated",slo_class="batch"\}', after)


def test_slo_config_file(tmp_path):
    path = tmp_path / "slo.json"
    path.write_text(json.dumps({"interactive": {"ttft_ms": 200, "itl_ms": 20, "priority": 0},
                                "bulk": {"ttft_ms": 60000, "itl_ms": 2000, "priority": 5, "max_queue_ms": 0}}))
    classes = load_slo_classes(str(path))
    assert classes["bulk"] == SLOClass(60000, 2000, 5, 0)
    path.write_text(json.dumps({"x": {"ttft_ms": 1, "itl_ms": 1, "colour": "red"}}))
    with pytest.raises(ValueError, match="colour"):
        load_slo_classes(str(path))
    # each target travels to the workers, which refuse what is not a finite number >= 0
    for bad in ("Infinity", "NaN", "-1", '"1000"'):
        path.write_text('{"x": {"ttft_ms": %s, "itl_ms": 1}}' % bad)
        with pytest.raises(ValueError, match="class 'x': ttft_ms: must be a finite number >= 0"):
            load_slo_classes(str(path))
    with pytest.raises(ValueError, match="itl_ms"):
        SLOClass(ttft_ms=1, itl_ms=float("inf"))


def test_config_checks_its_default_class():
    with pytest.raises(ValueError, match="default_slo_class"):
        RouterConfig(slo_classes={"batch": SLOClass(1, 1)})


def test_addresses_repeatable_and_comma_separated():
    assert parse_addresses(["a:1,b:2", "c:3", "a:1"]) == ("a:1", "b:2", "c:3")
    with pytest.raises(ValueError, match="host:port"):
        parse_addresses(["nohost"])
    d = StaticDiscovery(("a:1",), ("b:2",))
    assert (d.addresses("prefill"), d.addresses("decode")) == (("a:1",), ("b:2",))


def test_cli_runs_a_router_until_shutdown(cluster, tiny_llama_dir, capsys, monkeypatch):
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    prefill = ",".join(address_of(cluster, p) for p in cluster.prefills)
    args = parser.parse_args(["--model", tiny_llama_dir, "--port", "0", "--metrics-port", "0",
                              "--prefill", prefill, "--decode", address_of(cluster, cluster.decodes[0]),
                              "--decode", address_of(cluster, cluster.decodes[1]),
                              "--kvstore", address_of(cluster, cluster.kvstore), "--short-prompt-tokens", "8"])
    seen = {}

    def serve_one_request():  # stands in for waiting on SIGINT/SIGTERM
        address = re.search(r"serving on (\S+?),", capsys.readouterr().out).group(1)
        with RouterClient(address) as client:
            seen["gen"] = client.generate_text(LONG, SamplingParams(max_tokens=3))
        seen["address"] = address
    monkeypatch.setattr(router_main, "wait_for_shutdown", serve_one_request)
    assert router_main.run(args) == 0
    assert seen["gen"].finish_reason == "length" and len(seen["gen"].token_ids) == 3
    assert sum(len(p.requests) for p in cluster.prefills) == 1
    assert not is_serving(seen["address"], timeout=0.5)  # stopped


def test_cli_needs_decode_workers_and_may_have_no_prefill_pool():
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    with pytest.raises(ValueError, match="--decode"):
        router_main.config_from_args(parser.parse_args(["--prefill", "a:1"]))
    colocated = router_main.config_from_args(parser.parse_args(["--decode", "a:1"]))
    assert colocated.prefill_addresses == () and colocated.decode_addresses == ("a:1",)


def test_grpc_errors_reach_the_client_as_rpc_errors(cluster):
    with RouterClient(cluster.router.address) as client, pytest.raises(grpc.RpcError) as e:
        client.generate_text([1, 2], SamplingParams(max_tokens=2), slo_class="nope")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
