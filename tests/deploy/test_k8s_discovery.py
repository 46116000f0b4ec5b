"""KubernetesDiscovery against a scripted API server (fake_apiserver.py): the real
kubernetes client (DiscoveryV1Api, Watch) parses every answer; only sockets are faked."""
from __future__ import annotations

import argparse
import json
import time

import pytest
from kubernetes import client

from pdserve.services.router.state.discovery import DECODE, PREFILL
from pdserve.services.router.state.k8s_discovery import (KubernetesDiscovery, add_discovery_arguments, current_namespace,
                                                         discovery_from_args, kubernetes_discovery, ready_addresses)
from pdserve.services.router.state.workers import WorkerRegistry
from tests.deploy.fake_apiserver import FakeApiServer, endpoint_slice

PREFILL_SVC, DECODE_SVC = "rel-pdserve-prefill", "rel-pdserve-decode"
PREFILL_SEL, DECODE_SEL = (f"kubernetes.io/service-name={s}" for s in (PREFILL_SVC, DECODE_SVC))


def prefill_slice(name: str, *endpoints) -> dict:
    return endpoint_slice(name, PREFILL_SVC, list(endpoints), port=50070)


def decode_slice(name: str, *endpoints) -> dict:
    return endpoint_slice(name, DECODE_SVC, list(endpoints), port=50080)


def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@pytest.fixture
def server():
    s = FakeApiServer("llm")
    s.put_slice(prefill_slice("prefill-a", ("10.0.0.1", True), ("10.0.0.2", True)))
    s.put_slice(decode_slice("decode-a", ("10.0.1.1", True)))
    yield s
    s.close()


@pytest.fixture
def discovery(server):
    started = []

    def make(resync_s: float = 300.0, wait_s: float = 5.0, backoff_s: float = 0.01) -> tuple[KubernetesDiscovery, bool]:
        d = KubernetesDiscovery(server.api(), "llm", PREFILL_SEL, DECODE_SEL, resync_s=resync_s, backoff_s=backoff_s)
        started.append(d)
        return d, d.start(wait_s=wait_s)
    yield make
    for d in started:
        d.stop()


def _slice(obj: dict) -> client.V1EndpointSlice:
    return client.ApiClient().deserialize(json.dumps(obj), "V1EndpointSlice", "application/json")


# ready_addresses: one slice

def test_only_ready_endpoints_count_and_unknown_readiness_counts_as_ready():
    s = _slice(prefill_slice("p", ("10.0.0.1", True), ("10.0.0.2", False), ("10.0.0.3", None),
                             ("10.0.0.4", False, True)))
    assert ready_addresses(s, "grpc") == ("10.0.0.1:50070", "10.0.0.3:50070")


def test_the_named_port_is_used_and_a_slice_without_it_gives_nothing():
    s = _slice(endpoint_slice("p", PREFILL_SVC, [("10.0.0.1", True)], port=9090, port_name="metrics"))
    assert ready_addresses(s, "grpc") == ()
    assert ready_addresses(s, "metrics") == ("10.0.0.1:9090",)


def test_ipv6_addresses_are_bracketed():
    s = _slice(endpoint_slice("p", PREFILL_SVC, [("fd00::7", True)], port=50070, address_type="IPv6"))
    assert ready_addresses(s, "grpc") == ("[fd00::7]:50070",)


# the watchers, through the real client

def test_first_list_gives_each_pool_its_ready_workers(server, discovery):
    d, synced = discovery()
    assert synced
    assert d.addresses(PREFILL) == ("10.0.0.1:50070", "10.0.0.2:50070")
    assert d.addresses(DECODE) == ("10.0.1.1:50080",)


def test_requests_name_namespace_selector_and_watch_from_the_listed_version(server, discovery):
    discovery(resync_s=120)
    watches = server.wait_for_watches(2)
    path, first = server.requests[0]
    assert path == "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
    assert first["labelSelector"] in (PREFILL_SEL, DECODE_SEL) and "watch" not in first
    assert sorted(w.selector for w in watches) == sorted([PREFILL_SEL, DECODE_SEL])
    # the list answered resourceVersion 102 (two slices stamped after 100)
    assert {w.resource_version for w in watches} == {"102"}
    assert {w.timeout_seconds for w in watches} == {"120"}


def test_added_modified_and_deleted_slices_change_the_pool(server, discovery):
    d, _ = discovery()
    server.wait_for_watches(2)
    server.put_slice(prefill_slice("prefill-b", ("10.0.0.9", True)))
    wait_for(lambda: d.addresses(PREFILL) == ("10.0.0.1:50070", "10.0.0.2:50070", "10.0.0.9:50070"))
    server.put_slice(prefill_slice("prefill-a", ("10.0.0.1", True)))  # 10.0.0.2 gone from the slice
    wait_for(lambda: d.addresses(PREFILL) == ("10.0.0.1:50070", "10.0.0.9:50070"))
    server.delete_slice("prefill-a")
    wait_for(lambda: d.addresses(PREFILL) == ("10.0.0.9:50070",))
    assert d.addresses(DECODE) == ("10.0.1.1:50080",)  # the other pool's watch saw none of it


def test_readiness_flips_remove_and_restore_a_worker(server, discovery):
    d, _ = discovery()
    server.wait_for_watches(2)
    # draining: the pod turns not ready (and terminating), it leaves the pool
    server.put_slice(decode_slice("decode-a", ("10.0.1.1", False, True)))
    wait_for(lambda: d.addresses(DECODE) == ())
    server.put_slice(decode_slice("decode-a", ("10.0.1.1", True), ("10.0.1.2", False)))
    wait_for(lambda: d.addresses(DECODE) == ("10.0.1.1:50080",))
    server.put_slice(decode_slice("decode-a", ("10.0.1.1", True), ("10.0.1.2", True)))
    wait_for(lambda: d.addresses(DECODE) == ("10.0.1.1:50080", "10.0.1.2:50080"))


def test_410_gone_relists_and_picks_up_what_the_lost_history_held(server, discovery):
    d, _ = discovery(backoff_s=60)  # an error would wait that long: 410 must not
    server.wait_for_watches(2)
    lists = server.num_lists()
    # changes the watch never delivered (compacted history), then 410 on the open watches
    server.put_slice(prefill_slice("prefill-a", ("10.0.0.5", True)), silent=True)
    server.expire_watches()
    wait_for(lambda: d.addresses(PREFILL) == ("10.0.0.5:50070",))
    watches = server.wait_for_watches(2)
    assert server.num_lists() == lists + 2  # one re-list per pool, at once (no backoff wait)
    assert {w.resource_version for w in watches} == {"103"}  # watching again from the new list


def test_a_watch_that_times_out_is_followed_by_a_full_resync(server, discovery):
    d, _ = discovery(backoff_s=60)  # a normal end is no error: no backoff
    server.wait_for_watches(2)
    server.put_slice(decode_slice("decode-b", ("10.0.1.7", True)), silent=True)
    assert d.addresses(DECODE) == ("10.0.1.1:50080",)  # no event: not seen yet
    server.end_watches()  # timeoutSeconds ran out on the server
    wait_for(lambda: d.addresses(DECODE) == ("10.0.1.1:50080", "10.0.1.7:50080"))
    server.wait_for_watches(2)


def test_bookmarks_change_nothing(server, discovery):
    d, _ = discovery()
    server.wait_for_watches(2)
    server.bookmark()
    server.put_slice(prefill_slice("prefill-c", ("10.0.0.3", True)))  # an event after it still lands
    wait_for(lambda: "10.0.0.3:50070" in d.addresses(PREFILL))
    assert d.addresses(PREFILL) == ("10.0.0.1:50070", "10.0.0.2:50070", "10.0.0.3:50070")


def test_api_errors_keep_the_last_answer_and_it_recovers(server, discovery):
    d, _ = discovery()
    server.wait_for_watches(2)
    server.fail_lists(503, 4)  # the API server goes away for a while
    server.put_slice(prefill_slice("prefill-a", ("10.0.0.8", True)), silent=True)
    server.end_watches()
    wait_for(lambda: server.num_lists() >= 2 + 4)  # it kept trying through the failures
    wait_for(lambda: d.addresses(PREFILL) == ("10.0.0.8:50070",))
    assert d.addresses(DECODE) == ("10.0.1.1:50080",)


def test_start_does_not_wait_forever_when_the_api_refuses(server, discovery):
    server.fail_lists(403, 1000)  # e.g. the Role is missing
    t = time.monotonic()
    d, synced = discovery(wait_s=0.3)
    assert not synced and time.monotonic() - t < 2
    assert d.addresses(PREFILL) == () and d.addresses(DECODE) == ()
    server.stop_failing_lists()  # the Role is granted: the pools fill in
    wait_for(lambda: d.addresses(DECODE) == ("10.0.1.1:50080",))


def test_the_router_registry_follows_discovery(server, discovery):
    d, _ = discovery()
    server.wait_for_watches(2)
    registry = WorkerRegistry(d)
    try:
        assert [v.address for v in registry.views(PREFILL)] == ["10.0.0.1:50070", "10.0.0.2:50070"]
        server.delete_slice("prefill-a")
        server.put_slice(prefill_slice("prefill-z", ("10.0.0.4", True)))
        wait_for(lambda: d.addresses(PREFILL) == ("10.0.0.4:50070",))
        registry.sync()
        assert [v.address for v in registry.views(PREFILL)] == ["10.0.0.4:50070"]
    finally:
        registry.close()


def test_stop_ends_both_watch_threads(server, discovery):
    d, _ = discovery()
    server.wait_for_watches(2)
    d.stop(join_s=2.0)
    assert not any(t.is_alive() for t in d._threads)


def test_flags_are_checked_before_any_api_is_touched():
    with pytest.raises(ValueError, match="--prefill-selector"):
        kubernetes_discovery("llm", "", DECODE_SEL)
    with pytest.raises(ValueError, match="--discovery-resync-s"):
        kubernetes_discovery("llm", PREFILL_SEL, DECODE_SEL, resync_s=0)


def test_the_namespace_defaults_to_the_pods_own():
    assert current_namespace(lambda path: "llm-prod\n") == "llm-prod"

    def missing(path):
        raise FileNotFoundError(path)
    assert current_namespace(missing) == "default"


def test_the_flags_parse_and_static_discovery_builds_nothing():
    parser = argparse.ArgumentParser()
    add_discovery_arguments(parser)
    assert discovery_from_args(parser.parse_args([])) is None  # static, the default: the --prefill/--decode lists
    args = parser.parse_args(["--discovery=kubernetes", "--namespace=llm", f"--prefill-selector={PREFILL_SEL}",
                              f"--decode-selector={DECODE_SEL}", "--discovery-resync-s=60"])
    assert (args.namespace, args.prefill_selector, args.discovery_port_name, args.discovery_resync_s) == (
        "llm", PREFILL_SEL, "grpc", 60.0)


def test_outside_a_cluster_without_kubeconfig_the_error_says_so(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not in a pod and no usable kubeconfig"):
        kubernetes_discovery("llm", PREFILL_SEL, DECODE_SEL)
