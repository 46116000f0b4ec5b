"""Starting and stopping a worker process: the engine on its loop, the servicer behind a
gRPC server, /metrics, and the `pdserve prefill|decode` command."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine import EngineCore
from pdserve.services.common.grpc_server import RunningServer, ServiceSpec, start_server
from pdserve.services.common.kv_event_publisher import kv_events_service
from pdserve.services.common.process import configure_logging, set_cpu_threads, wait_for_shutdown
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.transports.reused_buffers import ReusedBuffers
from pdserve.services.worker.config import WorkerConfig, add_worker_arguments, worker_config_from_args
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.kv_seal import warn_if_unsealed
from pdserve.services.worker.prefix_cache_events import WorkerKVEvents
from pdserve.services.worker.metrics import WorkerMetrics
from pdserve.services.worker.servicer import WorkerServicer

# A worker's kvstore channel. A kvstore that restarts must be read from again within a
# second, not after gRPC's default reconnect backoff (1 s growing 1.6x per failed try to
# 2 min: about 30 s into a short outage), during which every long prompt is recomputed.
# RPCs still fail fast while it is down (no wait_for_ready): computing beats waiting.
KVSTORE_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                           ("grpc.max_reconnect_backoff_ms", 1000))


MakeServicer = Callable[[EngineLoop, WorkerMetrics, KVStoreClient], WorkerServicer]


# The worker's gRPC server threads (started on demand). Each open decode stream and each
# waiting prefill holds one for its life, and the router's load polls and health checks
# queue behind them when none is free: three polls timed out in a row and the router took
# a busy worker for lost, cutting every stream it had. Far past what routers send one
# worker (64 outstanding per router, the worker's own queue bound refusing more).
RPC_THREADS = 1024


@dataclass(frozen=True)
class WorkerService:
    """One gRPC service a worker serves over its engine (PrefillWorker, DecodeWorker)."""
    name: str            # full name, e.g. "pdserve.v1.DecodeWorker"
    register: Callable   # the generated add_*Servicer_to_server
    make_servicer: MakeServicer


@dataclass
class RunningWorker:
    server: RunningServer
    loop: EngineLoop
    # one per service, all over the one engine loop, sharing its metrics and kvstore client
    servicers: tuple[WorkerServicer, ...]
    metrics_port: int | None
    drain_timeout_s: float = 30.0
    kv_events: WorkerKVEvents | None = None  # the prefix cache's changes, for routers (KVEvents)

    @property
    def servicer(self) -> WorkerServicer:
        """The first service's (the only one but on a worker serving both roles)."""
        return self.servicers[0]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        """Drain: stop taking work (health NOT_SERVING, new calls refused as draining), let
        the calls in flight finish, then each servicer's own drain (a prefill's KV writes
        and their EndWrite, a decode's finished-request writes) while the engine still
        runs, and only then the engine and the kvstore connection.

        The server keeps answering GetLoad and health checks while the calls finish: a
        router that found it unreachable would count its open streams as lost and move
        them elsewhere, recomputing what this worker is about to finish."""
        deadline = time.monotonic() + self.drain_timeout_s
        for servicer in self.servicers:
            servicer.draining = True
        self.server.set_serving(False)
        if self.kv_events is not None:
            self.kv_events.close()  # its open streams would otherwise hold the drain's whole grace
        for servicer in self.servicers:
            servicer.in_flight.wait_idle(max(0.0, deadline - time.monotonic()))
        self.server.stop(grace=max(0.0, deadline - time.monotonic()))
        # calls cut at the grace's end still run their handlers: finish() waits for those
        # (they need the engine loop to end) before the kvstore is disconnected
        for servicer in self.servicers:
            servicer.finish()
        self.servicer.kvstore.close()
        self.loop.stop()
        self.servicer.metrics.metrics.close()


def build_engine(cfg: WorkerConfig, loaded=None) -> EngineCore:
    return EngineCore(cfg.engine, progress=False, loaded=loaded)


def kvstore_client(cfg: WorkerConfig) -> KVStoreClient:
    """The worker's one connection to its own kvstore (--kvstore): a handle naming another
    address is never followed, so no other client is ever needed."""
    return KVStoreClient(cfg.kvstore_address, transport=cfg.kvstore_transport, security=cfg.internal,
                         channel_options=KVSTORE_CHANNEL_OPTIONS, mooncake_local_node=cfg.mooncake_local_node)


# Exports a CPU worker keeps memory for: a prefill's put and a finished request's write
# can be in flight at once, each viewing its export until sent.
EXPORT_BUFFERS = 4


def choose_kv_export_memory(engine: EngineCore, kvstore: KVStoreClient, device: str, sealed: bool = False) -> None:
    """Where the engine exports the KV it puts: with the Mooncake plane through a store
    node on this host, shared memory that node maps (a put sends it from there as it is);
    on the CPU otherwise, buffers reused once the put has sent them, not fresh pages each
    time (services/kvstore/transports/reused_buffers.py: a 1,900-token prompt's 87 MB export faulted
    in afresh kept the prefill core in the kernel for most of a second). A GPU worker
    keeps the engine's own pinned allocation. `sealed`: blocks are encrypted before the put
    (kv_seal.py), into the shared memory themselves (kv_wire.payload_to_put's `out`), so
    the plain export goes to reused buffers."""
    import torch
    if kvstore.transport == "mooncake" and kvstore.mooncake_local_node != "off" and not sealed:
        def allocate(nbytes: int):
            buffer = kvstore.export_buffer(nbytes)
            return None if buffer is None else torch.from_numpy(buffer)
    elif torch.device(device).type == "cpu":
        buffers = ReusedBuffers(EXPORT_BUFFERS)

        def allocate(nbytes: int):
            return torch.frombuffer(buffers.take(nbytes), dtype=torch.uint8)
    else:
        return
    engine.set_kv_export_allocator(allocate)


def serve_worker(cfg: WorkerConfig, loaded, role: str, services: list[WorkerService]) -> RunningWorker:
    """`services` over one engine (a worker of role "both" serves PrefillWorker and
    DecodeWorker). `loaded`: weights already in memory (several workers over one model,
    as in tests)."""
    cfg = _without_prefill_speculation(cfg, role)
    metrics = WorkerMetrics(role, cfg.served_name)
    engine = build_engine(cfg, loaded)
    kvstore = kvstore_client(cfg)
    if cfg.kvstore_address:
        warn_if_unsealed(cfg.kv_keys)
    if kvstore.transport == "mooncake":
        metrics.watch_local_node(kvstore.local_node)
    choose_kv_export_memory(engine, kvstore, cfg.engine.device, sealed=cfg.kv_keys is not None)
    kv_events = WorkerKVEvents(engine.info)
    loop = EngineLoop(engine, on_step=metrics.update, on_kv_events=kv_events.on_events)
    loop.start()
    servicers = tuple(service.make_servicer(loop, metrics, kvstore) for service in services)
    specs = [ServiceSpec(service.name, service.register, servicer) for service, servicer in zip(services, servicers)]
    server = start_server([*specs, kv_events_service(kv_events.publisher)], cfg.host, cfg.port, security=cfg.security,
                          max_workers=RPC_THREADS)
    metrics_port = metrics.metrics.serve(cfg.host, cfg.metrics_port) if cfg.metrics_port is not None else None
    spec = cfg.engine.speculative_config
    logging.getLogger(__name__).info("%s worker on %s:%d (model %s%s)", role, cfg.host, server.port, cfg.engine.model,
                                     f", speculative decoding {spec.method} k={spec.num_speculative_tokens}"
                                     if spec else "")
    return RunningWorker(server, loop, servicers, metrics_port, cfg.drain_timeout_s, kv_events)


def _without_prefill_speculation(cfg: WorkerConfig, role: str) -> WorkerConfig:
    """A prefill worker takes a speculative config (one argument list may serve both pools,
    as with vLLM's prefill instances) but drops it: its requests end at their first token,
    so nothing is ever drafted, and a draft model would only take memory."""
    if role != "prefill" or cfg.engine.speculative_config is None:
        return cfg
    logging.getLogger(__name__).warning(
        "--speculative-config ignored: prefill workers do not speculate (decode workers do, after the hand-off)")
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, speculative_config=None))


def worker_cli(serves: dict[str, Callable[[WorkerConfig], RunningWorker]], default_port: int):
    """The `add_arguments` and `run` of `pdserve <role>`; `serves` by role, the first the
    command's own (more than one: --role chooses, `pdserve decode --role both`)."""
    roles = tuple(serves)

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_worker_arguments(parser, default_port, roles[0], roles)

    def run(args) -> int:
        role = args.role
        configure_logging(role)
        set_cpu_threads(args.threads)
        running = serves[role](worker_config_from_args(args))
        print(f"{role} worker serving on {args.host}:{running.server.port}", flush=True)
        wait_for_shutdown(running.loop.dead)
        if running.loop.dead.is_set():  # its requests already failed: nothing to drain
            logging.getLogger(__name__).critical("exiting: %s", running.loop.dead_reason)
            running.drain_timeout_s = 0.0
            running.stop()
            return 1
        # what the drain waits for, counted when the signal came (the operator's answer to
        # "why is it still up?")
        in_flight = sum(servicer.in_flight.count for servicer in running.servicers)
        logging.getLogger(__name__).info("draining and stopping: %d calls in flight", in_flight)
        running.stop()
        running.loop.shutdown_engine()
        return 0
    return add_arguments, run
