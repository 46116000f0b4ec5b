"""The KVStore gRPC service: each RPC calls its handler; a KVStoreError becomes the call's
status (the field it names in the details) and the server goes on serving other calls.

The UCX port of this server, if it has one, is sent as initial metadata of every Stats
answer: a client asked for transport="ucx" without an address finds the port there,
since the KVStore contract has no field for it.
"""
from __future__ import annotations

from collections.abc import Callable

import grpc

from services.kvstore.errors import KVStoreError
from services.kvstore.handlers import KVStoreHandlers
from services.kvstore.ucx_frames import UCX_PORT_METADATA
from services.pb import kvstore_pb2_grpc

SERVICE_NAME = "pdserve.v1.KVStore"


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, handlers: KVStoreHandlers, ucx_port: int | None = None):
        self.handlers = handlers
        self.ucx_port = ucx_port

    def Put(self, request_iterator, context):
        return _call(context, lambda: self.handlers.put(request_iterator, "grpc"))

    def Get(self, request, context):
        yield from _call(context, lambda: self.handlers.get(request, "grpc"))

    def Lookup(self, request, context):
        return _call(context, lambda: self.handlers.lookup(request))

    def CreateLease(self, request, context):
        return _call(context, lambda: self.handlers.create_lease(request))

    def ReleaseLease(self, request, context):
        return _call(context, lambda: self.handlers.release_lease(request))

    def Stats(self, request, context):
        if self.ucx_port is not None:
            context.send_initial_metadata([(UCX_PORT_METADATA, str(self.ucx_port))])
        return _call(context, self.handlers.stats)


def _call(context: grpc.ServicerContext, handler: Callable):
    try:
        return handler()
    except KVStoreError as e:
        context.abort(e.code(), e.details())
