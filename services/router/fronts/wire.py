"""Router.Generate's registration, with a request that does not parse answered as what it is.

gRPC Python parses a request before the servicer sees it, and answers a parse failure with
INTERNAL ("Exception deserializing request!"), as if the router were broken. A string field
that is not UTF-8 (a lone UTF-16 surrogate encoded raw, say) is the client's error: here
the parse failure travels to the handler as `Undecodable`, which refuses it with
INVALID_ARGUMENT. Otherwise the same handlers as the generated add_RouterServicer_to_server.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from pdserve.services.pb import common_pb2, router_pb2

SERVICE = "pdserve.v1.Router"


@dataclass(frozen=True)
class Undecodable:
    reason: str


def parse_generate_request(data: bytes) -> router_pb2.GenerateRequest | Undecodable:
    try:
        return router_pb2.GenerateRequest.FromString(data)
    except DecodeError as e:
        return Undecodable(str(e))


def add_router_to_server(servicer, server: grpc.Server) -> None:
    def generate(request, context):
        if isinstance(request, Undecodable):
            servicer.front.count_invalid()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a valid GenerateRequest "
                                                            "(every string field must be UTF-8 text)")
        yield from servicer.Generate(request, context)

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=parse_generate_request,
            response_serializer=common_pb2.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=router_pb2.ListModelsRequest.FromString,
            response_serializer=router_pb2.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
