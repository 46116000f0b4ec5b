"""How a KVStoreClient moves blocks: Put and Get, the calls that carry KV bytes, one block
per message; PutBlocks and GetBlocks, many blocks per message (the fast path). Lookup,
leases and stats are small and always go over gRPC."""
from __future__ import annotations

import abc

import grpc

from pdserve.services.kvstore import batch_codec
from pdserve.services.kvstore.batch_codec import Decoded, OutBatch
from pdserve.services.kvstore.errors import from_status
from pdserve.services.pb import kvstore_pb2, kvstore_pb2_grpc

_METHOD = "/pdserve.v1.KVStore/"


class BlockTransport(abc.ABC):
    """Put and Get against one kvstore. Both raise a KVStoreError (a grpc.RpcError) with
    the server's status when refused, UNAVAILABLE/DEADLINE_EXCEEDED when the server cannot
    be reached in time. Safe to call from many threads."""

    # Block bytes per PutBlocks message (at least one block each). The trade: a message of
    # one block is stored as it arrives; a message of many is copied apart by the memory
    # store (stores/memory.py, _owned) but costs fewer messages.
    put_batch_bytes: int = 0

    @abc.abstractmethod
    def put(self, requests: list[kvstore_pb2.PutRequest]) -> kvstore_pb2.PutResponse: ...

    @abc.abstractmethod
    def get(self, request: kvstore_pb2.GetRequest) -> list[kvstore_pb2.KVBlock]: ...

    @abc.abstractmethod
    def put_blocks(self, batches: list[OutBatch]) -> kvstore_pb2.PutResponse:
        """Each batch a PutBlocksRequest (its data unset) with the buffers of its bytes."""

    @abc.abstractmethod
    def get_blocks(self, request: kvstore_pb2.GetRequest) -> list[Decoded]:
        """The KVBlockBatch answers in order, their data viewed where they arrived."""

    def export_buffer(self, nbytes: int):
        """Memory for the engine to export `nbytes` of KV into that put_blocks then sends
        in place (a numpy uint8 array), or None: this transport has none (the default)."""
        return None

    def close(self) -> None:
        """Releases the connection; the default holds none of its own."""


class GrpcTransport(BlockTransport):
    """Put as a client stream, Get as a server stream, on a channel the client owns;
    PutBlocks and GetBlocks through the block codec (batch_codec.py). One block per
    PutBlocks message: a gRPC message costs little beside a block's hundreds of KB."""

    def __init__(self, channel: grpc.Channel, stub: kvstore_pb2_grpc.KVStoreStub, timeout_s: float):
        self._stub, self._timeout_s = stub, timeout_s
        self._put_blocks = channel.stream_unary(_METHOD + "PutBlocks", request_serializer=None,  # already bytes
                                                response_deserializer=kvstore_pb2.PutResponse.FromString)
        self._get_blocks = channel.unary_stream(
            _METHOD + "GetBlocks", request_serializer=kvstore_pb2.GetRequest.SerializeToString,
            response_deserializer=lambda data: batch_codec.decode(data, kvstore_pb2.KVBlockBatch))

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

    def put_blocks(self, batches):
        try:  # encoded one at a time, as gRPC asks for the next: building overlaps sending
            return self._put_blocks((batch.encode() for batch in batches), timeout=self._timeout_s)
        except grpc.RpcError as e:
            raise _translated(e) from None

    def get_blocks(self, request):
        try:  # a Get may wait for a pending write first: its time comes on top
            return list(self._get_blocks(request, timeout=self._timeout_s + request.wait_ms / 1000))
        except grpc.RpcError as e:
            raise _translated(e) from None


def _translated(error: grpc.RpcError) -> grpc.RpcError:
    """RESOURCE_EXHAUSTED as KVStoreFullError (callers catch it by name); others as they are."""
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return from_status(error.code(), error.details())
    return error
