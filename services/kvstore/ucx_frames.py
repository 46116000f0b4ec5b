"""The KVStore's Put and Get over UCX: the same protobuf messages as over gRPC, one per
UCX message (ucxx's send_obj/recv_obj frame each with its length), behind a kind byte.

    Put:  client  P<PutRequest> P<PutRequest> ... E            server  R<PutResponse> | X<error>
    Get:  client  G<GetRequest>                                 server  B<KVBlock> ... D | X<error>

An error frame carries the gRPC status name and the details, so a UCX caller sees the
same codes and messages as a gRPC one. One request at a time per connection.

A server's UCX port travels as gRPC initial metadata of Stats, under UCX_PORT_METADATA
(the KVStore contract has no field for it): both the servicer and the client read it
here, so the client never imports the server.
"""
from __future__ import annotations

import grpc

from services.kvstore.errors import InvalidArgument, KVStoreError, from_status

UCX_PORT_METADATA = "pdserve-kvstore-ucx-port"

PUT = b"P"
PUT_END = b"E"
GET = b"G"
PUT_REPLY = b"R"
BLOCK = b"B"
GET_END = b"D"
ERROR = b"X"


def frame(kind: bytes, message=None) -> bytes:
    return kind + (message.SerializeToString() if message is not None else b"")


def kind_of(data) -> bytes:
    return bytes(data[:1])


def parse(data, message_type):
    """The message after the kind byte; a frame that does not parse is the sender's error."""
    try:
        return message_type.FromString(memoryview(data)[1:])
    except Exception as e:  # protobuf's DecodeError, raised by its C extension
        raise InvalidArgument("frame", f"is not a valid {message_type.DESCRIPTOR.name}: {e}") from e


def error_frame(error: KVStoreError) -> bytes:
    return ERROR + f"{error.code().name}\n{error.details()}".encode()


def parse_error(data) -> KVStoreError:
    name, _, message = bytes(data[1:]).decode(errors="replace").partition("\n")
    code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    return from_status(code, message)
