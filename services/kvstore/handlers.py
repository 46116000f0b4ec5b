"""The KVStore API on protobuf messages, independent of the transport that carried them:
gRPC (grpc_servicer.py) and UCX (transports/ucx/server.py) both call these. A refused request
raises a KVStoreError whose status the transport sends back; the store is left as it was.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.services.kvstore.batch_codec import BATCH_BYTES, Decoded, OutBatch
from pdserve.services.kvstore.errors import InvalidArgument, KVStoreFullError, LeaseNotFound
from pdserve.services.kvstore.kv_metrics import KVStoreMetrics
from pdserve.services.kvstore.stores.base import BlockStore, StoredBlock
from pdserve.services.kvstore.validate import (indexed_blocks, key_for_hash, key_for_tail, missing, stored_block,
                                               stored_blocks, to_wire)
from pdserve.services.pb import kvstore_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeasePolicy:
    default_ttl_ms: int = 30_000  # CreateLease with ttl_ms = 0
    max_ttl_ms: int = 600_000     # a longer lease would pin blocks for a request long gone
    max_wait_ms: int = 60_000     # a Get waits at most this long for a pending write


class KVStoreHandlers:
    def __init__(self, store: BlockStore, metrics: KVStoreMetrics, leases: LeasePolicy = LeasePolicy(),
                 data_plane: bool = False):
        """`data_plane`: the bytes live in Mooncake Store (services/kvstore/transports/mooncake/plane.py):
        puts only index blocks already there and gets answer headers only; a request that
        carries or asks for bytes is refused, naming the flag it lacks."""
        self.store, self.metrics, self.leases = store, metrics, leases
        self.data_plane = data_plane

    def put(self, requests: Iterable[kvstore_pb2.PutRequest], transport: str) -> kvstore_pb2.PutResponse:
        if self.data_plane:
            raise InvalidArgument("put", _BYTES_ELSEWHERE + " send the bytes there and PutBlocks with "
                                         "bytes_in_data_plane")
        return self._put(lambda: _read_put(requests), transport)

    def put_blocks(self, requests: Iterable[Decoded], transport: str) -> kvstore_pb2.PutResponse:
        """PutBlocks: each message many blocks, their bytes viewed in the received message
        (or, with a data plane, only their headers: the bytes are already there)."""
        return self._put(lambda: _read_put_blocks(requests, self.data_plane), transport)

    def _put(self, read, transport: str) -> kvstore_pb2.PutResponse:
        start = time.perf_counter()
        transport = "mooncake" if self.data_plane else transport  # the bytes' way, not the index's
        try:
            blocks, lease_id = read()
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
        if self.data_plane:
            raise InvalidArgument("get", _BYTES_ELSEWHERE + " GetBlocks with headers_only names them")
        start = time.perf_counter()
        found, names = self._read(request)
        blocks = [to_wire(b) if b is not None else missing(*name) for b, name in zip(found, names, strict=True)]
        self._observe_get(transport, sum(len(b.data) for b in blocks), start)
        return blocks

    def get_blocks(self, request: kvstore_pb2.GetRequest, transport: str) -> list[OutBatch]:
        """GetBlocks: the same answer as get, as KVBlockBatch messages of about BATCH_BYTES,
        each block's stored bytes sent as they are (the transport joins or sends them)."""
        start = time.perf_counter()
        if self.data_plane != request.headers_only:
            raise InvalidArgument("headers_only", _BYTES_ELSEWHERE + " set it" if self.data_plane else
                                  "is set, but this kvstore has no data plane: its answer carries the bytes")
        found, names = self._read(request)
        batches, batch = [], _new_batch()
        for block, (block_hash, tail) in zip(found, names, strict=True):
            if block is None:
                batch.message.headers.add(block_hash=block_hash, tail_key=tail)
                batch.message.found.append(False)
                continue
            batch.message.headers.append(kvstore_pb2.KVBlockHeader.FromString(block.header))
            batch.message.found.append(True)
            if not self.data_plane:
                batch.buffers.append(block.data)
            if batch.num_bytes >= BATCH_BYTES:
                batches.append(batch)
                batch = _new_batch()
        if batch.message.headers or not batches:
            batches.append(batch)
        if self.data_plane:  # what the reader takes from the plane on this answer
            self._observe_get("mooncake", sum(b.num_bytes for b in found if b is not None), start)
        else:
            self._observe_get(transport, sum(b.num_bytes for b in batches), start)
        return batches

    def _read(self, request: kvstore_pb2.GetRequest) -> tuple[list[StoredBlock | None], list[tuple[bytes, str]]]:
        keys = ([key_for_hash(h, f"block_hashes[{i}]") for i, h in enumerate(request.block_hashes)]
                + [key_for_tail(k, f"tail_keys[{i}]") for i, k in enumerate(request.tail_keys)])
        if request.lease_id and request.wait_ms:
            # The write these blocks come from may still be running: give it time to end
            # (or fail) before reading; whatever is missing then is the reader's to recompute.
            self.store.wait_write(request.lease_id, min(request.wait_ms, self.leases.max_wait_ms) / 1000)
        names = [(h, "") for h in request.block_hashes] + [(b"", k) for k in request.tail_keys]
        return self.store.get(keys), names

    def _observe_get(self, transport: str, num_bytes: int, start: float) -> None:
        self.metrics.get_bytes.labels(transport).inc(num_bytes)
        self.metrics.get_seconds.labels(transport).observe(time.perf_counter() - start)

    def lookup(self, request: kvstore_pb2.LookupRequest) -> kvstore_pb2.LookupResponse:
        keys = [key_for_hash(h, f"block_hashes[{i}]") for i, h in enumerate(request.block_hashes)]
        return kvstore_pb2.LookupResponse(num_prefix_found=self.store.lookup(keys, request.lease_id))

    def create_lease(self, request: kvstore_pb2.CreateLeaseRequest) -> kvstore_pb2.Lease:
        ttl_ms = request.ttl_ms or self.leases.default_ttl_ms
        if ttl_ms > self.leases.max_ttl_ms:
            raise InvalidArgument("ttl_ms", f"{ttl_ms} is above the maximum {self.leases.max_ttl_ms}")
        lease_id = self.store.create_lease(ttl_ms, request.write_pending)
        logger.debug("lease %s for request %r, %d ms", lease_id, request.req_id, ttl_ms)
        return kvstore_pb2.Lease(lease_id=lease_id, ttl_ms=ttl_ms)

    def end_write(self, request: kvstore_pb2.EndWriteRequest) -> kvstore_pb2.EndWriteResponse:
        if not request.lease_id:
            raise InvalidArgument("lease_id", "is empty")
        return kvstore_pb2.EndWriteResponse(ended=self.store.end_write(request.lease_id, request.failed))

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


def _read_put_blocks(requests: Iterable[Decoded], data_plane: bool) -> tuple[list[StoredBlock], str]:
    """As _read_put, for PutBlocks messages; with a data plane, their index entries."""
    blocks, lease_id = [], ""
    for i, request in enumerate(requests):
        if request.error is not None:
            raise InvalidArgument(f"put[{i}].{request.error.field}", request.error.details().partition(": ")[2])
        message = request.message
        if message.lease_id and lease_id and message.lease_id != lease_id:
            raise InvalidArgument(f"put[{i}].lease_id", f"{message.lease_id!r} differs from {lease_id!r} "
                                                        "earlier in the stream")
        lease_id = lease_id or message.lease_id
        if message.bytes_in_data_plane != data_plane:
            raise InvalidArgument(f"put[{i}].bytes_in_data_plane", _BYTES_ELSEWHERE + " set it" if data_plane else
                                  "is set, but this kvstore has no data plane: send the bytes in data")
        if data_plane:
            blocks += indexed_blocks(message.headers, request.data, f"put[{i}]")
        else:
            blocks += stored_blocks(message.headers, request.data, f"put[{i}]")
    return blocks, lease_id


_BYTES_ELSEWHERE = "this kvstore keeps block bytes in its Mooncake data plane (--backend mooncake):"


def _new_batch() -> OutBatch:
    return OutBatch(kvstore_pb2.KVBlockBatch(), [])
