"""The KV cache service process: a BlockStore behind gRPC (with health and reflection),
optionally raw TCP and UCX for block bytes, Prometheus metrics, and a sweeper that ends
expired leases."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.services.common.grpc_server import RunningServer, ServiceSpec, start_server
from pdserve.services.common.kv_event_publisher import KVEventPublisher, kv_events_service
from pdserve.services.common.security import ServerSecurity, warn_if_open
from pdserve.services.kvstore.grpc_servicer import SERVICE_NAME, KVStoreServicer, add_to_server
from pdserve.services.kvstore.handlers import KVStoreHandlers, LeasePolicy
from pdserve.services.kvstore.block_events import PublishingMetrics
from pdserve.services.kvstore.kv_metrics import KVStoreMetrics
from pdserve.services.kvstore.transports.mooncake import plane as mooncake_plane
from pdserve.services.kvstore.stores.disk_tier import DiskTier
from pdserve.services.kvstore.stores.memory import MemoryBlockStore
from pdserve.services.kvstore.transports.mooncake.plane import MooncakeSettings
from pdserve.services.kvstore.stores.base import BlockStore, StoreEvents
from pdserve.services.kvstore.transports.tcp.server import TcpKVStoreServer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVStoreConfig:
    host: str = "127.0.0.1"
    port: int = 0                      # 0: a free port
    metrics_port: int | None = 0       # None: no /metrics endpoint
    capacity_bytes: int = 1 << 30
    backend: str = "memory"            # or redis://host:port/db, or "mooncake" (with `mooncake`)
    default_lease_ttl_ms: int = 30_000
    max_lease_ttl_ms: int = 600_000
    sweep_interval_ms: int = 1_000     # how often expired leases are ended in the background
    ucx_port: int | None = None        # None: no UCX listener; 0: a free port
    tcp_port: int | None = None        # None: no TCP listener for block bytes (transports/tcp/server.py); 0: a free port
    security: ServerSecurity = ServerSecurity()  # the internal token (every port), TLS (gRPC and TCP)
    disk_dir: str | None = None        # the memory backend's disk tier (stores/disk_tier.py); None: memory only
    disk_capacity_bytes: int | None = None  # its block bytes, with disk_dir
    mooncake: MooncakeSettings | None = None  # the data plane of backend "mooncake"

    def __post_init__(self):
        for name in ("capacity_bytes", "default_lease_ttl_ms", "max_lease_ttl_ms", "sweep_interval_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be positive")
        if self.default_lease_ttl_ms > self.max_lease_ttl_ms:
            raise ValueError(f"default_lease_ttl_ms: {self.default_lease_ttl_ms} is above max_lease_ttl_ms")
        for name in ("port", "metrics_port", "ucx_port", "tcp_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name}: {value} is not a port number")
        check_backend(self.backend)
        check_disk(self.backend, self.disk_dir, self.disk_capacity_bytes)
        if (self.backend == "mooncake") != (self.mooncake is not None):
            raise ValueError("mooncake: the Mooncake settings go with backend 'mooncake', and only with it")
        for name in ("ucx_port", "tcp_port"):
            if self.mooncake is not None and getattr(self, name) is not None:
                raise ValueError(f"{name}: with backend 'mooncake' the bytes move over Mooncake's transfer engine")


def check_backend(backend: str) -> None:
    if backend not in ("memory", "mooncake") and not backend.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"backend: {backend!r} is not 'memory', 'mooncake' or a redis://host:port/db URL")


def check_disk(backend: str, disk_dir: str | None, disk_capacity_bytes: int | None) -> None:
    if (disk_dir is None) != (disk_capacity_bytes is None):
        raise ValueError("disk_dir: a disk tier needs both disk_dir and disk_capacity_bytes")
    if disk_capacity_bytes is not None and disk_capacity_bytes <= 0:
        raise ValueError(f"disk_capacity_bytes: {disk_capacity_bytes} must be positive")
    if disk_dir is not None and backend != "memory":
        raise ValueError("disk_dir: a disk tier is for the memory backend only (Redis and Mooncake keep the "
                         "blocks themselves)")


def make_store(config: KVStoreConfig, events: StoreEvents, clock: Callable[[], float] | None = None) -> BlockStore:
    """The backend config.backend names; `clock` (seconds) replaces its default clock."""
    clock_arg = {"clock": clock} if clock else {}
    if config.backend == "memory":
        disk = DiskTier(config.disk_dir, config.disk_capacity_bytes) if config.disk_dir else None
        return MemoryBlockStore(config.capacity_bytes, events, **clock_arg, disk=disk)
    if config.backend == "mooncake":
        from pdserve.services.kvstore.stores.mooncake_index import MooncakeIndexStore  # loads nothing of Mooncake
        plane = mooncake_plane.connect(config.mooncake)
        return MooncakeIndexStore(config.capacity_bytes, config.mooncake, plane, events, **clock_arg)
    from pdserve.services.kvstore.stores.redis_store import RedisBlockStore  # only Redis deployments connect to one
    return RedisBlockStore(config.backend, config.capacity_bytes, events, **clock_arg)


class LeaseSweeper:
    """Ends expired leases every interval, so their pins go and the expiry metric counts
    them even when no request arrives (every store call also ends due leases itself)."""

    def __init__(self, store: BlockStore, interval_s: float):
        self._store, self._interval_s = store, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-lease-sweeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                self._store.expire_leases()
            except Exception as e:  # a backend outage must not end the sweeping for good
                logger.warning("lease sweep failed: %s", e)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


@dataclass
class RunningKVStore:
    address: str                 # "127.0.0.1:PORT"
    metrics_port: int | None
    ucx_address: str | None      # "host:PORT" when UCX is on
    store: BlockStore
    metrics: KVStoreMetrics
    servicer: KVStoreServicer
    _grpc: RunningServer
    _ucx: object | None
    _sweeper: LeaseSweeper
    kv_events: KVEventPublisher | None = None  # its blocks' changes, for routers (KVEvents)
    tcp_address: str | None = None  # "host:PORT" when TCP is on
    _tcp: object | None = None

    def stop(self, grace: float | None = 2.0) -> None:
        if self.kv_events is not None:
            self.kv_events.close()  # its open streams would otherwise hold the whole grace
        self._grpc.stop(grace)
        for listener in (self._ucx, self._tcp):
            if listener is not None:
                listener.stop()
        self.metrics.metrics.close()  # a no-op without a /metrics port
        self._sweeper.stop()
        self.store.close()


def serve(config: KVStoreConfig, clock: Callable[[], float] | None = None) -> RunningKVStore:
    """Starts the service; `clock` replaces the store's clock (tests expire leases with it)."""
    kv_events = KVEventPublisher()
    metrics = PublishingMetrics(kv_events)
    store = make_store(config, metrics, clock)
    metrics.watch(store.stats)
    handlers = KVStoreHandlers(store, metrics, LeasePolicy(config.default_lease_ttl_ms, config.max_lease_ttl_ms),
                               data_plane=config.mooncake is not None)
    ucx = tcp = grpc_server = None
    try:
        if config.ucx_port is not None:
            from pdserve.services.kvstore.transports.ucx.server import UcxKVStoreServer  # only a UCX-enabled server loads UCX
            ucx = UcxKVStoreServer(handlers, config.ucx_port, config.security.tokens)
            warn_if_open(config.security, f"UCX port {ucx.port}")
        if config.tcp_port is not None:
            tcp = TcpKVStoreServer(handlers, config.host, config.tcp_port, config.security.tokens,
                                   config.security.tls)
            warn_if_open(config.security, f"TCP port {tcp.port}")
        servicer = KVStoreServicer(handlers, ucx.port if ucx else None, config.mooncake,
                                   tcp.port if tcp else None)
        spec = ServiceSpec(SERVICE_NAME, add_to_server, servicer)
        grpc_server = start_server([spec, kv_events_service(kv_events)], host=config.host, port=config.port,
                                   security=config.security)
        metrics_port = None if config.metrics_port is None else metrics.metrics.serve(config.host, config.metrics_port)
    except BaseException:  # a port already taken: free what started before re-raising
        if grpc_server is not None:
            grpc_server.stop(0)
        for listener in (ucx, tcp):
            if listener is not None:
                listener.stop()
        store.close()
        raise
    sweeper = LeaseSweeper(store, config.sweep_interval_ms / 1000)
    return RunningKVStore(
        address=f"{config.host}:{grpc_server.port}", metrics_port=metrics_port,
        ucx_address=f"{config.host}:{ucx.port}" if ucx else None, store=store, metrics=metrics,
        servicer=servicer, _grpc=grpc_server, _ucx=ucx, _sweeper=sweeper, kv_events=kv_events,
        tcp_address=f"{config.host}:{tcp.port}" if tcp else None, _tcp=tcp)
