"""An in-test cluster: kvstore, prefill and decode workers and the router, in this process,
on free loopback ports, sharing one set of model weights (each worker has its own engine
and KV cache, as separate processes would)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.services.worker.config import WorkerConfig, with_kv_keys
from pdserve.services.worker.kv_seal import KVKeys
from pdserve.services.decode.server import serve as serve_decode
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.server import KVStoreConfig
from pdserve.services.kvstore.server import serve as serve_kvstore
from pdserve.services.prefill.server import serve as serve_prefill
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.router.server import serve as serve_router


@dataclass
class Cluster:
    kvstore: object
    prefills: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    router: object = None
    _kv_client: KVStoreClient | None = None

    def kvstore_client(self) -> KVStoreClient:
        if self._kv_client is None:
            self._kv_client = KVStoreClient(self.kvstore.address)
        return self._kv_client

    def workers(self) -> list:
        return [*self.prefills, *self.decodes]

    def stop(self) -> None:
        if self._kv_client is not None:
            self._kv_client.close()
        for part in [self.router, *self.workers(), self.kvstore]:
            if part is not None:
                part.stop()


def start_cluster(model: str, loaded, num_prefill: int = 2, num_decode: int = 1, short_prompt_tokens: int = 32,
                  kv_cache_memory_bytes: int | None = 8 << 20, kvstore_capacity: int = 64 << 20,
                  kvstore_transport: str = "grpc", kv_offloading_bytes: int | None = None,
                  kv_token: str | None = None, kvstore_disk_dir: str | None = None, **worker_overrides) -> Cluster:
    """`kv_token`: the platform token the workers seal, encrypt and name KV blocks with
    (services/worker/kv_seal.py); None: unkeyed checksums, as without a token.
    `kvstore_disk_dir`: the kvstore's disk tier there, as large as its memory."""
    ucx_port = 0 if kvstore_transport == "ucx" else None
    tcp_port = 0 if kvstore_transport == "tcp" else None
    cluster = Cluster(serve_kvstore(KVStoreConfig(
        capacity_bytes=kvstore_capacity, metrics_port=None, ucx_port=ucx_port, tcp_port=tcp_port,
        disk_dir=kvstore_disk_dir, disk_capacity_bytes=kvstore_capacity if kvstore_disk_dir else None)))
    try:
        engine = EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_bytes=kv_cache_memory_bytes,
                                                             kv_offloading_bytes=kv_offloading_bytes))
        cfg = WorkerConfig(engine=engine, kvstore_address=cluster.kvstore.address, metrics_port=0,
                           kvstore_transport=kvstore_transport, **worker_overrides)
        cfg = with_kv_keys(cfg, KVKeys.from_token(kv_token))
        cluster.prefills = [serve_prefill(cfg, loaded) for _ in range(num_prefill)]
        cluster.decodes = [serve_decode(cfg, loaded) for _ in range(num_decode)]
        cluster.router = serve_router(RouterConfig(
            model=model, prefill_addresses=tuple(p.address for p in cluster.prefills),
            decode_addresses=tuple(d.address for d in cluster.decodes), kvstore_address=cluster.kvstore.address,
            paths=PathConfig(policy="threshold"), short_prompt_tokens=short_prompt_tokens, port=0, metrics_port=0))
    except Exception:
        cluster.stop()
        raise
    return cluster
