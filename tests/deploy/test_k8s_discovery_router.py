"""The router on Kubernetes discovery, end to end: fake workers (tests/services/router/fakes.py)
announced only through EndpointSlices of the scripted API server. The router serves on
the endpoints the slices call ready, and stops choosing a worker once its endpoint turns
not ready (a pod that starts draining), without a restart."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams, load_tokenizer
from pdserve.services.common.grpc_server import RunningServer, ServiceSpec, start_server
from pdserve.services.pb import decode_pb2_grpc, kvstore_pb2_grpc, prefill_pb2_grpc
from pdserve.services.router.client import RouterClient
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.router.server import serve
from pdserve.services.router.state.discovery import DECODE, PREFILL
from pdserve.services.router.state.k8s_discovery import KubernetesDiscovery
from tests.deploy.fake_apiserver import FakeApiServer, endpoint_slice
from tests.services.router.fakes import FakeDecode, FakeKVStore, FakePrefill, expected_tokens, wait_until

SHORT = list(range(100, 120))   # at most short_prompt_tokens: straight to a decode worker
LONG = list(range(200, 260))    # prefill, then decode
PREFILL_SVC, DECODE_SVC = "rel-pdserve-prefill", "rel-pdserve-decode"


def _serve(name: str, register, servicer) -> RunningServer:
    return start_server([ServiceSpec(name, register, servicer)], "127.0.0.1", 0, max_workers=8)


class Workers:
    """Fake workers on loopback, each announced by an EndpointSlice of its own (own port)."""

    def __init__(self, api: FakeApiServer):
        self.api = api
        self.kvstore = FakeKVStore()
        self.servers: list[RunningServer] = [
            _serve("pdserve.v1.KVStore", kvstore_pb2_grpc.add_KVStoreServicer_to_server, self.kvstore)]
        self.kv_address = f"127.0.0.1:{self.servers[0].port}"
        self.prefill = FakePrefill(self.kv_address)
        self.decodes = [FakeDecode(), FakeDecode()]
        self.ports = {self.prefill: self._serve_prefill(self.prefill)}
        self.ports.update({d: self._serve_decode(d) for d in self.decodes})

    def _serve_prefill(self, p) -> int:
        register = prefill_pb2_grpc.add_PrefillWorkerServicer_to_server
        self.servers.append(_serve("pdserve.v1.PrefillWorker", register, p))
        return self.servers[-1].port

    def _serve_decode(self, d) -> int:
        register = decode_pb2_grpc.add_DecodeWorkerServicer_to_server
        self.servers.append(_serve("pdserve.v1.DecodeWorker", register, d))
        return self.servers[-1].port

    def announce(self, fake, ready: bool | None, terminating: bool = False) -> None:
        service = PREFILL_SVC if fake is self.prefill else DECODE_SVC
        name = f"{service}-{self.ports[fake]}"
        self.api.put_slice(endpoint_slice(name, service, [("127.0.0.1", ready, terminating)], port=self.ports[fake]))

    def address(self, fake) -> str:
        return f"127.0.0.1:{self.ports[fake]}"

    def stop(self) -> None:
        for server in self.servers:
            server.stop(grace=0)


@pytest.fixture
def platform(tiny_llama_dir):
    api = FakeApiServer("llm")
    workers = Workers(api)
    workers.announce(workers.prefill, True)
    workers.announce(workers.decodes[0], True)
    workers.announce(workers.decodes[1], False)  # still loading its model
    discovery = KubernetesDiscovery(api.api(), "llm", f"kubernetes.io/service-name={PREFILL_SVC}",
                                    f"kubernetes.io/service-name={DECODE_SVC}", backoff_s=0.01)
    router = client = None
    try:
        assert discovery.start(wait_s=5)
        cfg = RouterConfig(model=tiny_llama_dir, kvstore_address=workers.kv_address, short_prompt_tokens=32,
                           paths=PathConfig(policy="threshold"),
                           port=0, poll_interval_s=3600.0)  # polls only when the test asks: deterministic
        router = serve(cfg, tokenizer=load_tokenizer(tiny_llama_dir), discovery=discovery)
        client = RouterClient(router.address)
        yield workers, discovery, router, client
    finally:
        if client is not None:
            client.close()
        if router is not None:
            router.stop(grace_s=0)
        discovery.stop()
        api.close()
        workers.stop()


def _generate(client, prompt) -> list[int]:
    return [t for m in client.generate(prompt, SamplingParams(temperature=0, max_tokens=4), timeout_s=30)
            for t in m.token_ids]


def test_the_router_serves_on_the_ready_endpoints_and_follows_readiness(platform):
    workers, discovery, router, client = platform
    first, second = workers.decodes
    assert [v.address for v in router.registry.views(DECODE)] == [workers.address(first)]
    assert _generate(client, SHORT) == expected_tokens(len(SHORT), 4)
    assert _generate(client, LONG) == expected_tokens(len(LONG), 4)
    assert len(workers.prefill.requests) == 1 and len(first.requests) == 2 and not second.requests

    # the second decode pod turns ready; the first starts draining (terminating, not ready)
    workers.announce(second, True)
    workers.announce(first, False, terminating=True)
    wait_until(lambda: discovery.addresses(DECODE) == (workers.address(second),), "the slices' change")
    router.poll_now()  # the registry follows discovery at each poll
    assert _generate(client, SHORT) == expected_tokens(len(SHORT), 4)
    assert len(first.requests) == 2 and len(second.requests) == 1

    # the prefill pool's only slice is deleted: the decode pod prefills long prompts itself
    workers.api.delete_slice(f"{PREFILL_SVC}-{workers.ports[workers.prefill]}")
    wait_until(lambda: discovery.addresses(PREFILL) == (), "the prefill slice's deletion")
    router.poll_now()
    assert _generate(client, LONG) == expected_tokens(len(LONG), 4)
    assert len(workers.prefill.requests) == 1 and len(second.requests) == 2
    assert router.servicer.metrics.prefill_fallbacks._value.get() == 1
