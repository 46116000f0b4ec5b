"""Helpers for this folder's tests: routers with the HTTP API in front of a cluster's
workers, openai clients for them, raw HTTP, and waiting for a condition."""
from __future__ import annotations

import http.client
import json
import time

import openai

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.services.decode.server import serve as serve_decode
from pdserve.services.kvstore.server import KVStoreConfig
from pdserve.services.kvstore.server import serve as serve_kvstore
from pdserve.services.prefill.server import serve as serve_prefill
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.server import serve as serve_router
from pdserve.services.worker.config import WorkerConfig
from tests.services.cluster import Cluster

SHORT_PROMPT_TOKENS = 32  # longer prompts go prefill -> kvstore -> decode


def start_router(cluster: Cluster, model: str, tokenizer, http: HttpConfig | None = None, prefill=None, decode=None,
                 **overrides):
    """A router with its HTTP API on a free port, in front of the cluster's workers (or of
    the `prefill`/`decode` addresses given)."""
    cfg = RouterConfig(model=model, port=0, metrics_port=None,
                       prefill_addresses=tuple(prefill or (p.address for p in cluster.prefills)),
                       decode_addresses=tuple(decode or (d.address for d in cluster.decodes)),
                       kvstore_address=cluster.kvstore.address, paths=PathConfig(policy="threshold"),
                       short_prompt_tokens=SHORT_PROMPT_TOKENS, **overrides)
    return serve_router(cfg, tokenizer=tokenizer, http=http or HttpConfig(port=0))


def start_http_cluster(loaded, model: str) -> Cluster:
    """kvstore, one prefill and one decode worker on `loaded`, and a router with its HTTP API."""
    cluster = Cluster(serve_kvstore(KVStoreConfig(capacity_bytes=64 << 20, metrics_port=None)))
    try:
        cfg = WorkerConfig(engine=EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_bytes=8 << 20)),
                           kvstore_address=cluster.kvstore.address, metrics_port=None)
        cluster.prefills = [serve_prefill(cfg, loaded)]
        cluster.decodes = [serve_decode(cfg, loaded)]
        cluster.router = start_router(cluster, model, loaded.tokenizer)
    except Exception:
        cluster.stop()
        raise
    return cluster


def base_url(router) -> str:
    return f"http://127.0.0.1:{router.http_port}/v1"


def sync_client(router, api_key: str = "unused") -> openai.OpenAI:
    # no retries: a refusal must reach the test as the exception it is
    return openai.OpenAI(base_url=base_url(router), api_key=api_key, max_retries=0, timeout=120)


def async_client(router, api_key: str = "unused") -> openai.AsyncOpenAI:
    """Use inside `asyncio.run(...)`: the client belongs to that event loop."""
    return openai.AsyncOpenAI(base_url=base_url(router), api_key=api_key, max_retries=0, timeout=120)


def raw_request(router, method: str, path: str, body: dict | bytes | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one plain HTTP/1.1 request, as curl would send it."""
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=120)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def free_port() -> int:
    return free_port_range(1)  # below the ephemeral range: a process binds it later


def wait_until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached: {what}")
        time.sleep(0.05)


def requests_total(router, outcome: str, slo_class: str = "interactive") -> float:
    return router.metrics.metrics.value("router_requests_total", {"slo_class": slo_class, "outcome": outcome})
