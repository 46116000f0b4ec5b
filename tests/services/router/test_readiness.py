"""One readiness rule (services/router/state/readiness.py): the router is ready when a decode
worker is reachable. The gRPC health service and HTTP /health both follow it, round by
round of the load poller."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.services.common.grpc_server import channel
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.server import serve

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(router) -> dict[str, int]:
    """The status of the whole server ("") and of the Router service."""
    with channel(router.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return {name: stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
                for name in ("", "pdserve.v1.Router")}


def _http_health(router) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{router.http_port}/health", timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _nowhere() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_health_follows_the_decode_pool_round_by_round(make_cluster):
    cluster = make_cluster(num_prefill=1, num_decode=2)
    router = cluster.router
    assert _health(router) == {"": SERVING, "pdserve.v1.Router": SERVING}
    for d in cluster.decodes:
        d.load_fails = True
    router.poll_now()
    assert _health(router) == {"": NOT_SERVING, "pdserve.v1.Router": NOT_SERVING}
    cluster.decodes[1].load_fails = False
    router.poll_now()  # one decode worker is enough
    assert _health(router) == {"": SERVING, "pdserve.v1.Router": SERVING}


def test_prefill_workers_do_not_decide_readiness(make_cluster):
    cluster = make_cluster(num_prefill=2, num_decode=1)
    for p in cluster.prefills:
        p.load_fails = True
    cluster.router.poll_now()
    assert _health(cluster.router)["pdserve.v1.Router"] == SERVING  # a decode worker prefills itself


def test_router_with_no_decode_reachable_is_not_serving_from_the_start(tiny_llama_dir, tokenizer):
    router = serve(RouterConfig(model=tiny_llama_dir, decode_addresses=(_nowhere(),), port=0,
                                poll_interval_s=3600.0), tokenizer=tokenizer, http=HttpConfig(port=0))
    try:
        assert _health(router) == {"": NOT_SERVING, "pdserve.v1.Router": NOT_SERVING}
        status, body = _http_health(router)
        assert status == 503 and body == {"status": "unavailable", "workers_up": {"prefill": 0, "decode": 0}}
    finally:
        router.stop(grace_s=0)


def test_colocated_router_is_ready_over_http_with_a_decode_worker(make_cluster, tiny_llama_dir, tokenizer):
    workers = make_cluster(num_prefill=0, num_decode=1)  # fake workers; a second router, with HTTP, in front
    decode = workers.router.registry.views("decode")[0].address
    router = serve(RouterConfig(model=tiny_llama_dir, decode_addresses=(decode,), port=0, poll_interval_s=3600.0),
                   tokenizer=tokenizer, http=HttpConfig(port=0))
    try:
        status, body = _http_health(router)
        assert status == 200 and body == {"status": "ok", "workers_up": {"prefill": 0, "decode": 1}}
        workers.decodes[0].load_fails = True
        router.poll_now()
        assert _http_health(router)[0] == 503
        assert _health(router)["pdserve.v1.Router"] == NOT_SERVING
    finally:
        router.stop(grace_s=0)


def test_grpc_health_says_serving_only_once_the_http_api_listens(make_cluster, tiny_llama_dir, tokenizer,
                                                                  monkeypatch):
    """`pdserve up` (and a probe) read SERVING as "every front accepts requests": while the HTTP
    API is still starting, a ready decode pool must not make the gRPC health say SERVING
    (seen: a test's first HTTP request refused right after `pdserve is up` on a loaded machine)."""
    from pdserve.cli.bench.local_platform import free_port
    from pdserve.services.common.grpc_server import is_serving
    from pdserve.services.router.fronts.http.server import HttpServer

    workers = make_cluster(num_prefill=0, num_decode=1)
    decode = workers.router.registry.views("decode")[0].address
    port = free_port()
    seen_while_starting = []
    start = HttpServer.start

    def checking_start(self, *args, **kwargs):
        seen_while_starting.append(is_serving(f"127.0.0.1:{port}", timeout=5))
        return start(self, *args, **kwargs)

    monkeypatch.setattr(HttpServer, "start", checking_start)
    router = serve(RouterConfig(model=tiny_llama_dir, decode_addresses=(decode,), port=port, poll_interval_s=3600.0),
                   tokenizer=tokenizer, http=HttpConfig(port=0))
    try:
        assert seen_while_starting == [False]
        assert _health(router)["pdserve.v1.Router"] == SERVING
        assert _http_health(router)[0] == 200
    finally:
        router.stop(grace_s=0)
