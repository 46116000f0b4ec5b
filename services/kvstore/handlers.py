"""The KVStore API on protobuf messages, independent of the transport that carried them:
gRPC (grpc_servicer.py) and UCX (ucx_server.py) both call these. A refused request
raises a KVStoreError whose status the transport sends back; the store is left as it was.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from services.kvstore.errors import InvalidArgument, KVStoreFullError, LeaseNotFound
from services.kvstore.kv_metrics import KVStoreMetrics
from services.kvstore.store import BlockStore, StoredBlock
from services.kvstore.validate import key_for_hash, key_for_tail, missing, stored_block, to_wire
from services.pb import kvstore_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeasePolicy:
    default_ttl_ms: int = 30_000  # CreateLease with ttl_ms = 0
    max_ttl_ms: int = 600_000     # a longer lease would pin blocks for a request long gone


class KVStoreHandlers:
    def __init__(self, store: BlockStore, metrics: KVStoreMetrics, leases: LeasePolicy = LeasePolicy()):
        self.store, self.metrics, self.leases = store, metrics, leases

    def put(self, requests: Iterable[kvstore_pb2.PutRequest], transport: str) -> kvstore_pb2.PutResponse:
        start = time.perf_counter()
        try:
            blocks, lease_id = _read_put(requests)
        except InvalidArgument:
            self.metrics.puts_rejected_total.labels("invalid").inc()
            raise
        try:
            num_stored = self.store.put(blocks, lease_id)
        except LeaseNotFound:
            self.metrics.puts_rejected_total.labels("lease").inc()
            raise
        if num_stored is None:
            raise KVStoreFullError(f"{sum(b.num_bytes for b in blocks)} bytes do not fit in capacity "
                                   f"{self.store.capacity_bytes} beside the pinned blocks; nothing was stored")
        num_bytes = sum(b.num_bytes for b in blocks)
        self.metrics.put_bytes.labels(transport).inc(num_bytes)
        self.metrics.put_seconds.labels(transport).observe(time.perf_counter() - start)
        return kvstore_pb2.PutResponse(num_stored=num_stored, num_bytes=num_bytes)

    def get(self, request: kvstore_pb2.GetRequest, transport: str) -> list[kvstore_pb2.KVBlock]:
        """Blocks in request order, hashes then tails; found=False for a missing one."""
        start = time.perf_counter()
        keys = ([key_for_hash(h, f"block_hashes[{i}]") for i, h in enumerate(request.block_hashes)]
                + [key_for_tail(k, f"tail_keys[{i}]") for i, k in enumerate(request.tail_keys)])
        found = self.store.get(keys)
        names = [(h, "") for h in request.block_hashes] + [(b"", k) for k in request.tail_keys]
        blocks = [to_wire(b) if b is not None else missing(*name) for b, name in zip(found, names, strict=True)]
        self.metrics.get_bytes.labels(transport).inc(sum(len(b.data) for b in blocks))
        self.metrics.get_seconds.labels(transport).observe(time.perf_counter() - start)
        return blocks

    def lookup(self, request: kvstore_pb2.LookupRequest) -> kvstore_pb2.LookupResponse:
        keys = [key_for_hash(h, f"block_hashes[{i}]") for i, h in enumerate(request.block_hashes)]
        return kvstore_pb2.LookupResponse(num_prefix_found=self.store.lookup(keys))

    def create_lease(self, request: kvstore_pb2.CreateLeaseRequest) -> kvstore_pb2.Lease:
        ttl_ms = request.ttl_ms or self.leases.default_ttl_ms
        if ttl_ms > self.leases.max_ttl_ms:
            raise InvalidArgument("ttl_ms", f"{ttl_ms} is above the maximum {self.leases.max_ttl_ms}")
        lease_id = self.store.create_lease(ttl_ms)
        logger.debug("lease %s for request %r, %d ms", lease_id, request.req_id, ttl_ms)
        return kvstore_pb2.Lease(lease_id=lease_id, ttl_ms=ttl_ms)

    def release_lease(self, request: kvstore_pb2.ReleaseLeaseRequest) -> kvstore_pb2.ReleaseLeaseResponse:
        if not request.lease_id:
            raise InvalidArgument("lease_id", "is empty")
        return kvstore_pb2.ReleaseLeaseResponse(released=self.store.release_lease(request.lease_id,
                                                                                  request.drop_tail))

    def stats(self) -> kvstore_pb2.KVStoreStats:
        s = self.store.stats()
        return kvstore_pb2.KVStoreStats(
            capacity_bytes=s.capacity_bytes, used_bytes=s.used_bytes, num_blocks=s.num_blocks,
            num_pinned_blocks=s.num_pinned_blocks, num_active_leases=s.num_active_leases,
            num_hits=s.num_hits, num_misses=s.num_misses, num_evictions=s.num_evictions)


def _read_put(requests: Iterable[kvstore_pb2.PutRequest]) -> tuple[list[StoredBlock], str]:
    """The stream's blocks and its lease. The lease may be named on every message or only
    the first; two different lease ids in one stream are refused."""
    blocks, lease_id = [], ""
    for i, request in enumerate(requests):
        if request.lease_id and lease_id and request.lease_id != lease_id:
            raise InvalidArgument(f"put[{i}].lease_id", f"{request.lease_id!r} differs from {lease_id!r} "
                                                        "earlier in the stream")
        lease_id = lease_id or request.lease_id
        if not request.HasField("block"):
            raise InvalidArgument(f"put[{i}].block", "is missing")
        blocks.append(stored_block(request.block, f"put[{i}].block"))
    return blocks, lease_id
