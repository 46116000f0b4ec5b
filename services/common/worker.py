"""What the prefill and decode workers share: config, engine construction, metrics, load."""
from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine import CacheConfig, EngineConfig, EngineCore, SchedulerConfig
from services.common.engine_loop import EngineLoop, LoopStats
from services.common.grpc_server import RunningServer, ServiceSpec, start_server
from services.common.metrics import Metrics
from services.common.process import configure_logging, set_cpu_threads, wait_for_shutdown
from services.pb import common_pb2

@dataclass(frozen=True)
class WorkerConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "torch"
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    kvstore_address: str = ""
    kvstore_transport: str = "grpc"
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 2048  # None: max_model_len
    long_prefill_token_threshold: int = 512
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    max_waiting: int = 256  # admission bound: beyond it the worker answers RESOURCE_EXHAUSTED
    lease_ttl_ms: int = 60_000
    drain_timeout_s: float = 30.0  # on shutdown: how long in-flight requests may take to finish


def add_worker_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--kvstore", default="127.0.0.1:50060", help="KV cache service address")
    parser.add_argument("--kvstore-transport", default="grpc", choices=["grpc", "ucx"])
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step (default 2048; with --no-chunked-prefill, "
                             "the max model len)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="schedule each prompt whole in one step; --max-num-batched-tokens must "
                             "then be at least the max model len")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for this worker")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM: how long in-flight requests may take to finish")


def worker_config_from_args(args) -> WorkerConfig:
    return WorkerConfig(
        model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        host=args.host, port=args.port, metrics_port=args.metrics_port, kvstore_address=args.kvstore,
        kvstore_transport=args.kvstore_transport, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=_max_num_batched_tokens(args),
        long_prefill_token_threshold=args.long_prefill_token_threshold, max_model_len=args.max_model_len,
        enable_chunked_prefill=not args.no_chunked_prefill, drain_timeout_s=args.drain_timeout_s)


def _max_num_batched_tokens(args) -> int | None:
    """Unchunked, the budget must hold the longest prompt: None lets the engine use max_model_len,
    which is only known once the model and the KV pool are sized."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return None if args.no_chunked_prefill else WorkerConfig.max_num_batched_tokens


def build_engine(cfg: WorkerConfig, loaded=None) -> EngineCore:
    config = EngineConfig(
        model=cfg.model, dtype=cfg.dtype, device=cfg.device, attention_backend=cfg.attention_backend,
        cache=CacheConfig(enable_prefix_caching=cfg.enable_prefix_caching,
                          kv_cache_memory_bytes=cfg.kv_cache_memory_bytes),
        scheduler=SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                  cfg.long_prefill_token_threshold, cfg.max_model_len,
                                  cfg.enable_chunked_prefill))
    return EngineCore(config, progress=False, loaded=loaded)


class WorkerMetrics:
    """The metrics both worker kinds export; `role` is "prefill" or "decode"."""

    def __init__(self, role: str):
        self.role = role
        m = self.metrics = Metrics()
        self.ttft = m.histogram("worker_ttft_seconds", "Time to first token inside the worker")
        self.itl = m.histogram("worker_itl_seconds", "Inter-token latency inside the worker")
        self.e2e = m.histogram("worker_e2e_seconds", "Request time inside the worker")
        self.queue = m.histogram("worker_queue_seconds", "Arrival until first scheduled")
        self.kv_transfer = m.histogram("kv_transfer_seconds", "KV transfer with the kvstore", ("direction",))
        self.prompt_tokens = m.counter("prefill_tokens_total", "Prompt tokens computed or imported")
        self.generated_tokens = m.counter("decode_tokens_total", "Tokens generated")
        self.requests = m.counter("worker_requests_total", "Requests by outcome", ("outcome",))
        self.running = m.gauge("requests_running", "Requests in the running batch")
        self.waiting = m.gauge("requests_waiting", "Requests waiting for admission")
        self.blocks_used = m.gauge("kv_blocks_used", "KV cache blocks in use")
        self.blocks_free = m.gauge("kv_blocks_free", "KV cache blocks free")
        self.prefix_queried = m.gauge("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = m.gauge("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        self.kvstore_imported = m.counter("kvstore_imported_tokens_total", "Prompt tokens imported from the kvstore")
        self.recompute = m.counter("recompute_fallbacks_total", "Blocks the kvstore no longer had, recomputed")
        self.kv_write_failures = m.counter("kv_write_failures_total", "Prefills whose KV could not be stored")

    def update(self, stats: LoopStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_free.set(stats.num_free_kv_blocks)
        self.blocks_used.set(stats.num_total_kv_blocks - stats.num_free_kv_blocks)
        self.prefix_queried.set(stats.prefix_cache_queried_tokens)
        self.prefix_hits.set(stats.prefix_cache_hit_tokens)


def worker_load(loop: EngineLoop, cfg: WorkerConfig, draining: bool) -> common_pb2.WorkerLoad:
    s = loop.stats
    return common_pb2.WorkerLoad(
        num_running=s.num_running, num_waiting=s.num_waiting, queued_prefill_tokens=s.num_queued_prefill_tokens,
        num_free_kv_blocks=s.num_free_kv_blocks, num_total_kv_blocks=s.num_total_kv_blocks,
        max_num_seqs=cfg.max_num_seqs, draining=draining)


def check_admission(loop: EngineLoop, cfg: WorkerConfig, context: grpc.ServicerContext, draining: bool) -> None:
    if draining:
        context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
    if loop.stats.num_waiting >= cfg.max_waiting:
        context.set_trailing_metadata((("retry-after-ms", "500"),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"worker queue full ({loop.stats.num_waiting} waiting); retry later")


def now() -> float:
    return time.monotonic()


class WorkerServicer:
    """What RunningWorker needs of a worker's servicer."""
    draining: bool
    metrics: WorkerMetrics

    def close(self) -> None:
        """Release the servicer's own clients (kvstore connections)."""


@dataclass
class RunningWorker:
    server: RunningServer
    loop: EngineLoop
    servicer: WorkerServicer
    metrics_port: int | None
    drain_timeout_s: float = 30.0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        """Drain: stop taking work (health NOT_SERVING), let in-flight calls finish, stop."""
        self.servicer.draining = True
        self.server.stop(grace=self.drain_timeout_s)
        self.loop.stop()
        self.servicer.metrics.metrics.close()
        self.servicer.close()


def serve_worker(cfg: WorkerConfig, loaded, role: str, service_name: str, register,
                 make_servicer: Callable[[EngineLoop, WorkerMetrics], WorkerServicer]) -> RunningWorker:
    metrics = WorkerMetrics(role)
    loop = EngineLoop(build_engine(cfg, loaded), on_step=metrics.update)
    loop.start()
    servicer = make_servicer(loop, metrics)
    server = start_server([ServiceSpec(service_name, register, servicer)], cfg.host, cfg.port)
    metrics_port = metrics.metrics.serve(cfg.host, cfg.metrics_port) if cfg.metrics_port is not None else None
    logging.getLogger(__name__).info("%s worker on %s:%d (model %s)", role, cfg.host, server.port, cfg.model)
    return RunningWorker(server, loop, servicer, metrics_port, cfg.drain_timeout_s)


def worker_cli(role: str, serve: Callable[[WorkerConfig], RunningWorker], default_port: int):
    """The `add_arguments` and `run` of `pdserve <role>`."""
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_worker_arguments(parser, default_port)

    def run(args) -> int:
        configure_logging(role)
        set_cpu_threads(args.threads)
        running = serve(worker_config_from_args(args))
        print(f"{role} worker serving on {args.host}:{running.server.port}", flush=True)
        wait_for_shutdown()
        logging.getLogger(__name__).info("draining and stopping")
        running.stop()
        return 0
    return add_arguments, run
