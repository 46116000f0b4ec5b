"""The router service: Router.Generate and Router.ListModels over gRPC, with health,
reflection and /metrics, and beside them the OpenAI-compatible HTTP API (`http/`), served
by the same Front. `serve(config)` wires the parts (see docs/router.md):

    RouterServicer ─┐ GenerateInput
    http (FastAPI) ─┴──────────────▶ Front: RequestValidator, outcome counts
                                       └▶ GenerateFlow ─▶ Pool(prefill) / Pool(decode) ─▶ WorkerCalls
                                          │ policies, admission gate
                       LoadPoller ─▶ WorkerRegistry ◀─ Discovery
                           └ each round ─▶ Readiness ─▶ gRPC health, HTTP /health
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from engine import InvalidRequestError
from services.common.convert import sampling_from_proto
from services.common.defaults import HOST
from services.common.grpc_server import RunningServer, ServiceSpec, start_server
from services.pb import router_pb2, router_pb2_grpc
from services.router.admission import AdmissionGate
from services.router.calls import WorkerCalls
from services.router.cancel import Cancellation
from services.router.config import RouterConfig
from services.router.discovery import DECODE, PREFILL, Discovery, StaticDiscovery
from services.router.drain import Drain, DrainingFront, DrainingReadiness
from services.router.errors import RouterError
from services.router.flow import GenerateFlow
from services.router.front import Front
from services.router.http.backend import Backend
from services.router.http.config import HttpConfig
from services.router.http.server import HttpServer
from services.router.kv_index import KVIndex
from services.router.metrics import RouterMetrics
from services.router.model_info import ModelInfo, describe_model, tokenizer_for
from services.router.paths import AdaptivePaths, ColocatedPaths, PathPolicy, ThresholdPaths
from services.router.placement import KVSources, placement_policies
from services.router.policy import SaturationPolicy, WorkerPolicy
from services.router.poller import LoadPoller
from services.router.pools import Pool
from services.router.readiness import Readiness
from services.router.security import max_request_bytes
from services.router.request import GenerateInput, RequestValidator
from services.router.wire import add_router_to_server
from services.router.workers import WorkerRegistry

logger = logging.getLogger(__name__)

_NO_DEADLINE_S = 365 * 24 * 3600.0
_FINAL_MESSAGE_S = 2.0  # after a drain: for the last (error) messages to reach their clients


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, cfg: RouterConfig, model: ModelInfo, front: Front | DrainingFront):
        self.cfg, self.model, self.front = cfg, model, front

    @property
    def metrics(self) -> RouterMetrics:
        return self.front.metrics

    def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(
            id=self.model.name, max_model_len=self.model.max_model_len, vocab_size=self.model.vocab_size)])

    def Generate(self, request, context):
        arrival = time.monotonic()
        try:
            req = self.front.validate(_input(request))
        except InvalidRequestError as e:
            self.front.count_invalid()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        cancel = Cancellation()
        # runs when the RPC ends (a no-op on calls already done); False: it has ended already
        if not context.add_callback(cancel.cancel):
            cancel.cancel()
        try:
            yield from self.front.run(req, arrival, cancel, lambda: self._time_left(context))
        except RouterError as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata(e.trailing_metadata())
            context.abort(e.code, e.message)

    def _time_left(self, context) -> float | None:
        """A worker call's timeout: the client's remaining deadline, capped by the config."""
        left = context.time_remaining()
        limit = self.cfg.worker_timeout_s
        if left is None or left > _NO_DEADLINE_S:  # grpc reports "no deadline" as ~292 years
            return limit
        return left if limit is None else min(left, limit)


def _input(msg: router_pb2.GenerateRequest) -> GenerateInput:
    """Raises InvalidRequestError for a bad sampling field (the engine's own checks)."""
    which = msg.WhichOneof("prompt")
    prompt = msg.text if which == "text" else tuple(msg.token_ids.ids) if which == "token_ids" else ()
    return GenerateInput(prompt, sampling_from_proto(msg.sampling), msg.req_id, msg.slo_class, msg.model,
                         msg.cache_salt)


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
        """Drain, then stop (drain.py): new requests are refused at once (gRPC UNAVAILABLE,
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
    """Start the router; `tokenizer` may be passed when the caller already has it loaded.
    `http`: also serve the OpenAI-compatible API (None: gRPC only)."""
    model = describe_model(cfg.model, cfg.max_model_len)
    tokenizer = tokenizer if tokenizer is not None else tokenizer_for(cfg.model)
    metrics = RouterMetrics(cfg.slo_classes)
    gates = {pool: AdmissionGate(cfg.max_queued_requests,
                                 lambda cls, n, pool=pool: metrics.queued.labels(pool, cls).set(n))
             for pool in (PREFILL, DECODE)}
    registry = WorkerRegistry(discovery or StaticDiscovery(cfg.prefill_addresses, cfg.decode_addresses),
                              on_change=lambda pool: gates[pool].wake(), security=cfg.internal,
                              kvstore_address=cfg.kvstore_address)
    kv_index = KVIndex(cfg.kv_index_max_blocks)
    kv_sources = KVSources(cfg, registry, kv_index)
    pools = _pools(cfg, registry, gates, metrics, placement_policies(
        cfg, kv_index, colocated=discovery is None and not cfg.prefill_addresses,
        count=lambda pool, reason: metrics.placements.labels(pool, reason).inc()))
    readiness = Readiness(registry)

    def after_round() -> None:
        _after_round(metrics, registry, readiness)
        kv_sources.sync()  # follow the workers discovery found (and the kvstore)
        metrics.update_kv_index(kv_index)
    poller = LoadPoller(registry, cfg.poll_interval_s, cfg.poll_timeout_s, after_round=after_round)
    poller.poll_once()  # know who is up before the first request
    poller.start()
    calls = WorkerCalls(registry)
    paths = path_policy(cfg, colocated=discovery is None and not cfg.prefill_addresses)
    flow = GenerateFlow(pools, paths, calls, metrics, cfg.kvstore_address, cfg.retry_after_ms)
    validator = RequestValidator(model, tokenizer, cfg.slo_classes, cfg.default_slo_class,
                                 cfg.grammar_compile_timeout_s)
    drain = Drain()
    front = DrainingFront(Front(validator, flow, metrics), drain)
    servicer = RouterServicer(cfg, model, front)
    server = http_server = None
    try:
        server = start_server([ServiceSpec("pdserve.v1.Router", add_router_to_server,
                                           servicer)], cfg.host, cfg.port, max_workers=cfg.max_concurrent_streams,
                              serving=readiness.ready(), security=cfg.public,
                              max_receive_bytes=max_request_bytes(cfg.max_request_bytes, model.max_model_len))
        readiness.publish_to(server)
        metrics_port = metrics.metrics.serve(cfg.host, cfg.metrics_port) if cfg.metrics_port is not None else None
        if http is not None:
            backend = Backend(model, tokenizer, front, DrainingReadiness(readiness, drain), cfg.worker_timeout_s,
                              time.time())
            http_server = HttpServer(http, backend).start()
    except Exception:  # e.g. a port in use: leave no poller thread, channels or ports behind
        if server is not None:
            server.stop(0)
        metrics.metrics.close()
        poller.stop()
        kv_sources.close()
        registry.close()
        raise
    logger.info("router on %s:%d: %d prefill, %d decode workers%s (model %s)", cfg.host, server.port,
                len(cfg.prefill_addresses), len(cfg.decode_addresses),
                " (colocated: no prefill pool)" if paths.colocated else f" ({cfg.paths.policy} paths)", model.name)
    return RunningRouter(server, servicer, registry, poller, calls, metrics, metrics_port, pools, readiness,
                         cfg.host, http_server, kv_index, kv_sources, drain)


def path_policy(cfg: RouterConfig, colocated: bool) -> PathPolicy:
    """`colocated`: the router was given no prefill pool at all (not one that is down)."""
    if colocated or cfg.paths.policy == "colocated":
        return ColocatedPaths()
    if cfg.paths.policy == "threshold":
        return ThresholdPaths(cfg.short_prompt_tokens, cfg.slo_classes)
    return AdaptivePaths(cfg.paths, cfg.slo_classes)


def _after_round(metrics: RouterMetrics, registry: WorkerRegistry, readiness: Readiness) -> None:
    metrics.update_workers(registry)
    readiness.update()


def _pools(cfg: RouterConfig, registry: WorkerRegistry, gates: dict[str, AdmissionGate],
           metrics: RouterMetrics, policies: dict[str, WorkerPolicy]) -> dict[str, Pool]:
    saturation = SaturationPolicy(cfg.saturation)
    reject = lambda pool, cls: metrics.rejections.labels(pool, cls).inc()  # noqa: E731
    return {pool: Pool(pool, registry, saturation, policies[pool], gates[pool], cfg.retry_after_ms, reject)
            for pool in (PREFILL, DECODE)}
