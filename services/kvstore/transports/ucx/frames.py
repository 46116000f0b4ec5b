"""The KVStore's Put and Get over UCX: the same protobuf messages as over gRPC, one per
UCX message (ucxx's send_obj/recv_obj frame each with its length), behind a kind byte.

    Hello:      client  A<len><token><padding>                 server  K | X<UNAUTHENTICATED>, closes
    Put:        client  P<PutRequest> P<PutRequest> ... E      server  R<PutResponse> | X<error>
    Get:        client  G<GetRequest>                           server  B<KVBlock> ... D | X<error>
    PutBlocks:  client  Q<sizes><PutBlocksRequest> raw... E     server  R<PutResponse> | X<error>
    GetBlocks:  client  H<GetRequest>                           server  C<sizes><KVBlockBatch> raw... D | X<error>

PutBlocks and GetBlocks send each batch's message without its data, then the data as
raw UCX messages of the sizes listed in the frame (a u32 count, then u64 sizes): UCX
moves them straight from the sender's buffers (a tensor's memory, stored block bytes;
a CUDA tensor too, through its __cuda_array_interface__) into the buffer the receiver
allocated for them, with no framing copy on either side.

Every connection begins with the hello, once: the client's internal token (empty when it
has none), in a fixed-size message, so the server reads it into a small buffer of its own
before it trusts the peer with any allocation (recv_obj allocates what the sender says).
A server configured with tokens refuses a missing or wrong one and closes the connection.

An error frame carries the gRPC status name and the details, so a UCX caller sees the
same codes and messages as a gRPC one. One request at a time per connection.

A server's UCX port travels as gRPC initial metadata of Stats, under UCX_PORT_METADATA
(the KVStore contract has no field for it): both the servicer and the client read it
here, so the client never imports the server.
"""
from __future__ import annotations

import struct

import grpc

from pdserve.services.kvstore.errors import InvalidArgument, KVStoreError, from_status

UCX_PORT_METADATA = "pdserve-kvstore-ucx-port"

HELLO = b"A"
HELLO_OK = b"K"
HELLO_BYTES = 1024  # the hello's fixed size; a token fits in HELLO_BYTES - 3

PUT = b"P"
PUT_END = b"E"
GET = b"G"
PUT_BLOCKS = b"Q"
GET_BLOCKS = b"H"
PUT_REPLY = b"R"
BLOCK = b"B"
BATCH = b"C"
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


def hello_frame(token: str | None) -> bytes:
    data = (token or "").encode()
    if len(data) > HELLO_BYTES - 3:
        raise ValueError(f"internal token: {len(data)} bytes, UCX takes at most {HELLO_BYTES - 3}")
    return (HELLO + struct.pack("<H", len(data)) + data).ljust(HELLO_BYTES, b"\0")


def hello_token(data) -> bytes | None:
    """The token a hello carries (b"" for none); None when `data` is no hello."""
    if len(data) != HELLO_BYTES or kind_of(data) != HELLO:
        return None
    (size,) = struct.unpack_from("<H", data, 1)
    return bytes(data[3:3 + size]) if size <= HELLO_BYTES - 3 else None


def error_frame(error: KVStoreError) -> bytes:
    return ERROR + f"{error.code().name}\n{error.details()}".encode()


def parse_error(data) -> KVStoreError:
    name, _, message = bytes(data[1:]).decode(errors="replace").partition("\n")
    code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    return from_status(code, message)


def batch_frame(kind: bytes, message, sizes: list[int]) -> bytes:
    """A batch's frame: the sizes of the raw messages that follow it, then its message."""
    return kind + struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes) + message.SerializeToString()


def batch_sizes(data) -> list[int]:
    """The sizes a batch frame lists: read first, so the raw messages are received (and
    the stream stays in step) even when the message itself turns out bad."""
    try:
        (count,) = struct.unpack_from("<I", data, 1)
        return list(struct.unpack_from(f"<{count}Q", data, 5))
    except struct.error as e:
        raise InvalidArgument("frame", f"has no valid size list: {e}") from None


def parse_batch_frame(data, message_type, num_sizes: int):
    """The message of a batch frame listing `num_sizes` sizes."""
    # parse() skips one kind byte: hand it the frame from the last byte before the message
    return parse(memoryview(data)[4 + 8 * num_sizes:], message_type)


async def send_batch(endpoint, kind: bytes, batch) -> None:
    """A batch's frame, then each of its buffers (an OutBatch's) as one raw UCX message."""
    sizes = [_nbytes(b) for b in batch.buffers]
    await endpoint.send_obj(batch_frame(kind, batch.message, sizes))
    for buffer, size in zip(batch.buffers, sizes):
        if size:
            await endpoint.send(buffer)


async def recv_raw(endpoint, sizes: list[int]) -> memoryview:
    """The raw messages of a batch, received one after another into one host buffer."""
    buffer = memoryview(bytearray(sum(sizes)))
    offset = 0
    for size in sizes:
        if size:
            await endpoint.recv(buffer[offset:offset + size])
        offset += size
    return buffer


def _nbytes(buffer) -> int:
    """Bytes of a host buffer (bytes, memoryview, numpy) or a CUDA tensor."""
    return buffer.nbytes if hasattr(buffer, "nbytes") else len(buffer)
