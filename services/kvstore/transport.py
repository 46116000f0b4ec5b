"""How a KVStoreClient moves blocks: Put and Get, the calls that carry KV bytes.
Lookup, leases and stats are small and always go over gRPC."""
from __future__ import annotations

import abc

import grpc

from services.kvstore.errors import from_status
from services.pb import kvstore_pb2, kvstore_pb2_grpc


class BlockTransport(abc.ABC):
    """Put and Get against one kvstore. Both raise a KVStoreError (a grpc.RpcError) with
    the server's status when refused, UNAVAILABLE/DEADLINE_EXCEEDED when the server cannot
    be reached in time. Safe to call from many threads."""

    @abc.abstractmethod
    def put(self, requests: list[kvstore_pb2.PutRequest]) -> kvstore_pb2.PutResponse: ...

    @abc.abstractmethod
    def get(self, request: kvstore_pb2.GetRequest) -> list[kvstore_pb2.KVBlock]: ...

    def close(self) -> None:
        """Releases the connection; the default holds none of its own."""


class GrpcTransport(BlockTransport):
    """Put as a client stream, Get as a server stream, on a channel the client owns."""

    def __init__(self, stub: kvstore_pb2_grpc.KVStoreStub, timeout_s: float):
        self._stub, self._timeout_s = stub, timeout_s

    def put(self, requests):
        try:
            return self._stub.Put(iter(requests), timeout=self._timeout_s)
        except grpc.RpcError as e:
            raise _translated(e) from None

    def get(self, request):
        try:
            return list(self._stub.Get(request, timeout=self._timeout_s))
        except grpc.RpcError as e:
            raise _translated(e) from None


def _translated(error: grpc.RpcError) -> grpc.RpcError:
    """RESOURCE_EXHAUSTED as KVStoreFullError (callers catch it by name); others as they are."""
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return from_status(error.code(), error.details())
    return error
