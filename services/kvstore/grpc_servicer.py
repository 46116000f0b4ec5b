"""The KVStore gRPC service: each RPC calls its handler; a KVStoreError becomes the call's
status (the field it names in the details) and the server goes on serving other calls.

PutBlocks and GetBlocks are registered with the codec of batch_codec.py instead of
protobuf's: their block bytes are viewed in the received message and joined once into
the sent one (see add_to_server). Every other method uses the generated serializers.

The UCX and TCP ports of this server, if it has them, are sent as initial metadata of every
Stats answer: a client asked for transport="ucx" or "tcp" without an address finds the port there,
since the KVStore contract has no field for it. So are a Mooncake data plane's settings
(transport="mooncake" connects to the plane they name).
"""
from __future__ import annotations

from collections.abc import Callable

import grpc

from pdserve.services.kvstore import batch_codec
from pdserve.services.kvstore.errors import InvalidArgument, KVStoreError
from pdserve.services.kvstore.handlers import KVStoreHandlers
from pdserve.services.kvstore.transports.mooncake.plane import MOONCAKE_METADATA, MooncakeSettings
from pdserve.services.kvstore.transports.tcp.frames import TCP_PORT_METADATA
from pdserve.services.kvstore.transports.ucx.frames import UCX_PORT_METADATA
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.pb import kvstore_pb2_grpc

SERVICE_NAME = "pdserve.v1.KVStore"


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, handlers: KVStoreHandlers, ucx_port: int | None = None,
                 mooncake: MooncakeSettings | None = None, tcp_port: int | None = None):
        self.handlers = handlers
        self.ucx_port, self.tcp_port = ucx_port, tcp_port
        metadata = [(UCX_PORT_METADATA, str(ucx_port))] if ucx_port is not None else []
        metadata += [(TCP_PORT_METADATA, str(tcp_port))] if tcp_port is not None else []
        metadata += [(MOONCAKE_METADATA, mooncake.to_json())] if mooncake is not None else []
        self._stats_metadata = tuple(metadata)

    def Put(self, request_iterator, context):
        return _call(context, lambda: self.handlers.put(request_iterator, "grpc"))

    def Get(self, request, context):
        yield from _call(context, lambda: self.handlers.get(request, "grpc"))

    def PutBlocks(self, request_iterator, context):
        """Requests arrive decoded by _decode_put_blocks."""
        return _call(context, lambda: self.handlers.put_blocks(request_iterator, "grpc"))

    def GetBlocks(self, request, context):
        """Yields each batch already encoded (the method's serializer passes bytes on)."""
        for batch in _call(context, lambda: self.handlers.get_blocks(request, "grpc")):
            yield batch.encode()

    def Lookup(self, request, context):
        return _call(context, lambda: self.handlers.lookup(request))

    def CreateLease(self, request, context):
        return _call(context, lambda: self.handlers.create_lease(request))

    def EndWrite(self, request, context):
        return _call(context, lambda: self.handlers.end_write(request))

    def ReleaseLease(self, request, context):
        return _call(context, lambda: self.handlers.release_lease(request))

    def Stats(self, request, context):
        if self._stats_metadata:
            context.send_initial_metadata(self._stats_metadata)
        return _call(context, self.handlers.stats)


def _call(context: grpc.ServicerContext, handler: Callable):
    try:
        return handler()
    except KVStoreError as e:
        context.abort(e.code(), e.details())


def _decode_put_blocks(data: bytes) -> batch_codec.Decoded:
    # A malformed message surfaces as INVALID_ARGUMENT from the handler, not as a
    # deserialization failure (which gRPC reports as INTERNAL, without the field).
    try:
        return batch_codec.decode(data, pb.PutBlocksRequest)
    except InvalidArgument as e:
        return batch_codec.Decoded(pb.PutBlocksRequest(), memoryview(b""), error=e)


def add_to_server(servicer: KVStoreServicer, server: grpc.Server) -> None:
    """As the generated add_KVStoreServicer_to_server, with the block codec on PutBlocks
    and GetBlocks."""
    def unary(method, request, response):
        return grpc.unary_unary_rpc_method_handler(method, request_deserializer=request.FromString,
                                                   response_serializer=response.SerializeToString)
    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(servicer.Put, request_deserializer=pb.PutRequest.FromString,
                                                    response_serializer=pb.PutResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(servicer.Get, request_deserializer=pb.GetRequest.FromString,
                                                    response_serializer=pb.KVBlock.SerializeToString),
        "PutBlocks": grpc.stream_unary_rpc_method_handler(servicer.PutBlocks, request_deserializer=_decode_put_blocks,
                                                          response_serializer=pb.PutResponse.SerializeToString),
        "GetBlocks": grpc.unary_stream_rpc_method_handler(servicer.GetBlocks,
                                                          request_deserializer=pb.GetRequest.FromString,
                                                          response_serializer=None),  # already bytes
        "Lookup": unary(servicer.Lookup, pb.LookupRequest, pb.LookupResponse),
        "CreateLease": unary(servicer.CreateLease, pb.CreateLeaseRequest, pb.Lease),
        "EndWrite": unary(servicer.EndWrite, pb.EndWriteRequest, pb.EndWriteResponse),
        "ReleaseLease": unary(servicer.ReleaseLease, pb.ReleaseLeaseRequest, pb.ReleaseLeaseResponse),
        "Stats": unary(servicer.Stats, pb.StatsRequest, pb.KVStoreStats),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
