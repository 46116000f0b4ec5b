"""The router service: Router.Generate and Router.ListModels over gRPC, with health,
reflection and /metrics, and beside them the OpenAI-compatible HTTP API (fronts/http/),
served by the same Front. `serve(config)` wires the parts (see docs/router.md):

    RouterServicer ─┐ GenerateInput
    http (FastAPI) ─┴──────────────▶ Front: RequestValidator, Drain, outcome counts
                                       └▶ GenerateFlow ─▶ Pool(prefill) / Pool(decode) ─▶ WorkerCalls
                                          │ decide/: paths, placement, saturation; admission gate
                       LoadPoller ─▶ WorkerRegistry ◀─ Discovery
                           └ each round ─▶ Readiness ─▶ gRPC health, HTTP /health
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pdserve.engine.chat import load_chat_template, with_chat_template
from pdserve.services.common.defaults import HOST
from pdserve.services.common.grpc_server import RunningServer, ServiceSpec, start_server
from pdserve.services.router.config import RouterConfig, max_request_bytes
from pdserve.services.router.core.admission import AdmissionGate
from pdserve.services.router.core.calls import WorkerCalls
from pdserve.services.router.core.drain import Drain, DrainingReadiness
from pdserve.services.router.core.flow import GenerateFlow
from pdserve.services.router.core.front import Front
from pdserve.services.router.core.model_info import ModelInfo, describe_model, tokenizer_for
from pdserve.services.router.core.pools import Pool
from pdserve.services.router.core.request import RequestValidator
from pdserve.services.router.decide.paths import path_policy
from pdserve.services.router.decide.placement import placement_policies
from pdserve.services.router.decide.policy import WorkerPolicy
from pdserve.services.router.decide.saturation import SaturationPolicy
from pdserve.services.router.fronts.grpc_servicer import RouterServicer
from pdserve.services.router.fronts.http.backend import Backend
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.fronts.http.server import HttpServer
from pdserve.services.router.fronts.wire import add_router_to_server
from pdserve.services.router.metrics import RouterMetrics
from pdserve.services.router.state.discovery import DECODE, PREFILL, Discovery, StaticDiscovery
from pdserve.services.router.state.kv_index import KVIndex
from pdserve.services.router.state.kv_subscriber import KVSources
from pdserve.services.router.state.poller import LoadPoller
from pdserve.services.router.state.readiness import Readiness
from pdserve.services.router.state.workers import WorkerRegistry

logger = logging.getLogger(__name__)

_FINAL_MESSAGE_S = 2.0  # after a drain: for the last (error) messages to reach their clients


@dataclass
class RunningRouter:
    server: RunningServer
    servicer: RouterServicer
    registry: WorkerRegistry
    poller: LoadPoller
    calls: WorkerCalls
    metrics: RouterMetrics
    metrics_port: int | None
    pools: dict[str, Pool]
    readiness: Readiness
    host: str = HOST
    http: HttpServer | None = None  # the OpenAI-compatible API, when enabled
    kv_index: KVIndex | None = None  # which blocks each worker holds (placement "kv")
    kv_sources: KVSources | None = None
    drain: Drain = field(default_factory=Drain)  # SIGTERM: refuse new requests, finish those in flight

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    @property
    def address(self) -> str:
        host = HOST if self.host in ("0.0.0.0", "::", "[::]", "") else self.host
        return f"{host}:{self.server.port}"

    def poll_now(self) -> None:
        """One load poll right away (tests use it instead of waiting for the background one)."""
        self.poller.poll_once()

    def stop(self, grace_s: float = 5.0) -> None:
        """Drain, then stop (core/drain.py): new requests are refused at once (gRPC UNAVAILABLE,
        HTTP 503, health NOT_SERVING); those in flight get `grace_s` (the drain timeout)
        to finish; any still running then end with an error that says so."""
        self.drain.start()
        self.poller.stop()  # first: a last round must not turn the stopping server's health back on
        self.server.set_serving(False)
        if not self.drain.wait_idle(grace_s):
            num_cut = self.drain.cut(grace_s)
            logger.warning("drain timeout (%g s): ending %d requests still in flight with an error", grace_s, num_cut)
            self.drain.wait_idle(_FINAL_MESSAGE_S)
        # the same short grace for both servers: what is left are final messages on their way out
        if self.http is not None:
            self.http.stop(_FINAL_MESSAGE_S)
        self.server.stop(_FINAL_MESSAGE_S)
        self.calls.close()
        if self.kv_sources is not None:
            self.kv_sources.close()
        self.registry.close()


def serve(cfg: RouterConfig, tokenizer=None, discovery: Discovery | None = None,
          http: HttpConfig | None = None) -> RunningRouter:
    """Start the router; `tokenizer` may be passed when the caller already has it loaded
    (it is left as it is: cfg.chat_template goes on a copy). `http`: also serve the
    OpenAI-compatible API (None: gRPC only)."""
    template = load_chat_template(cfg.chat_template) if cfg.chat_template is not None else None  # fails first
    model = describe_model(cfg.model, cfg.max_model_len, cfg.revision, cfg.served_model_names)
    tokenizer = with_chat_template(tokenizer if tokenizer is not None else tokenizer_for(cfg.model, cfg.revision),
                                   template)
    colocated = discovery is None and not cfg.prefill_addresses  # given no prefill pool (not one that is down)
    metrics = RouterMetrics(cfg.slo_classes)
    gates = _gates(cfg, metrics)
    watch = _watch_workers(cfg, discovery, gates, metrics)
    pools = _pools(cfg, watch.registry, gates, metrics, placement_policies(
        cfg, watch.kv_index, colocated, count=lambda pool, reason: metrics.placements.labels(pool, reason).inc()))
    calls = WorkerCalls(watch.registry)
    paths = path_policy(cfg, colocated)
    drain = Drain()
    validator = RequestValidator(model, tokenizer, cfg.slo_classes, cfg.default_slo_class,
                                 cfg.grammar_compile_timeout_s)
    flow = GenerateFlow(pools, paths, calls, metrics, cfg.kvstore_address, cfg.retry_after_ms,
                        min(c.ttft_ms for c in cfg.slo_classes.values()))
    front = Front(validator, flow, metrics, drain)
    servicer = RouterServicer(cfg, model, front)
    try:
        servers = _start_servers(cfg, http, servicer, watch.readiness, tokenizer)
    except Exception:  # e.g. a port in use: leave no poller thread, channels or ports behind
        metrics.metrics.close()
        watch.close()
        raise
    logger.info("router on %s:%d: %d prefill, %d decode workers%s (model %s)", cfg.host, servers.grpc.port,
                len(cfg.prefill_addresses), len(cfg.decode_addresses),
                " (colocated: no prefill pool)" if paths.colocated else f" ({cfg.paths.policy} paths)",
                model.served_name)
    return RunningRouter(servers.grpc, servicer, watch.registry, watch.poller, calls, metrics, servers.metrics_port,
                         pools, watch.readiness, cfg.host, servers.http, watch.kv_index, watch.kv_sources, drain)


def _gates(cfg: RouterConfig, metrics: RouterMetrics) -> dict[str, AdmissionGate]:
    return {pool: AdmissionGate(cfg.max_queued_requests,
                                lambda cls, n, pool=pool: metrics.queued.labels(pool, cls).set(n))
            for pool in (PREFILL, DECODE)}


@dataclass
class _WorkerWatch:
    """What the poller keeps up to date, polled once already (the first request knows who is up)."""
    registry: WorkerRegistry
    kv_index: KVIndex
    kv_sources: KVSources
    readiness: Readiness
    poller: LoadPoller

    def close(self) -> None:
        self.poller.stop()
        self.kv_sources.close()
        self.registry.close()


def _watch_workers(cfg: RouterConfig, discovery: Discovery | None, gates: dict[str, AdmissionGate],
                   metrics: RouterMetrics) -> _WorkerWatch:
    registry = WorkerRegistry(discovery or StaticDiscovery(cfg.prefill_addresses, cfg.decode_addresses),
                              on_change=lambda pool: gates[pool].wake(), security=cfg.internal,
                              kvstore_address=cfg.kvstore_address)
    kv_index = KVIndex(cfg.kv_index_max_blocks)
    kv_sources = KVSources(cfg, registry, kv_index)
    readiness = Readiness(registry)

    def after_round() -> None:
        metrics.update_workers(registry)
        readiness.update()
        kv_sources.sync()  # follow the workers discovery found (and the kvstore)
        metrics.update_kv_index(kv_index, cfg.kvstore_address)
    poller = LoadPoller(registry, cfg.poll_interval_s, cfg.poll_timeout_s, after_round=after_round)
    poller.poll_once()
    poller.start()
    return _WorkerWatch(registry, kv_index, kv_sources, readiness, poller)


def _pools(cfg: RouterConfig, registry: WorkerRegistry, gates: dict[str, AdmissionGate],
           metrics: RouterMetrics, policies: dict[str, WorkerPolicy]) -> dict[str, Pool]:
    saturation = SaturationPolicy(cfg.saturation)
    reject = lambda pool, cls: metrics.rejections.labels(pool, cls).inc()  # noqa: E731
    return {pool: Pool(pool, registry, saturation, policies[pool], gates[pool], cfg.retry_after_ms, reject)
            for pool in (PREFILL, DECODE)}


@dataclass(frozen=True)
class _Servers:
    grpc: RunningServer
    metrics_port: int | None
    http: HttpServer | None


def _start_servers(cfg: RouterConfig, http: HttpConfig | None, servicer: RouterServicer, readiness: Readiness,
                   tokenizer) -> _Servers:
    """The gRPC API, /metrics and the HTTP API; none left running when one fails to start.
    The gRPC health says NOT_SERVING until the HTTP API listens too: `pdserve up` and a
    Kubernetes probe take SERVING to mean every front of the router accepts requests."""
    server = start_server([ServiceSpec("pdserve.v1.Router", add_router_to_server, servicer)], cfg.host, cfg.port,
                          max_workers=cfg.server_threads, serving=False, security=cfg.public,
                          max_receive_bytes=max_request_bytes(cfg.max_request_bytes, servicer.model.max_model_len))
    try:
        metrics = servicer.metrics.metrics
        metrics_port = metrics.serve(cfg.host, cfg.metrics_port) if cfg.metrics_port is not None else None
        http_server = _start_http(cfg, http, servicer, readiness, tokenizer) if http is not None else None
        readiness.publish_to(server)
    except Exception:
        server.stop(0)
        raise
    return _Servers(server, metrics_port, http_server)


def _start_http(cfg: RouterConfig, http: HttpConfig, servicer: RouterServicer, readiness: Readiness,
                tokenizer) -> HttpServer:
    front = servicer.front
    backend = Backend(servicer.model, tokenizer, front, DrainingReadiness(readiness, front.drain),
                      cfg.worker_timeout_s, time.time())
    return HttpServer(http, backend).start()
