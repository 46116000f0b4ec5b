"""PutBlocks and GetBlocks over a plain TCP connection (TLS optional): a fixed header, the
protobuf message without its data, then the block bytes raw.

    frame:  "KV" | version u8 | kind u8 | message length u32 | data length u64 |  message  |  data
            ^------------------- 16 bytes, little-endian -------------------^

    Hello:      client  HELLO<token>                            server  HELLO_OK | ERROR<UNAUTHENTICATED>, closes
    PutBlocks:  client  PUT_BLOCKS<PutBlocksRequest><bytes> ... PUT_END
                                                                server  PUT_REPLY<PutResponse> | ERROR
    GetBlocks:  client  GET_BLOCKS<GetRequest>                  server  BATCH<KVBlockBatch><bytes> | ERROR

The message is PutBlocksRequest or KVBlockBatch with `data` unset (headers only, tens of
bytes per block); the data is the blocks' bytes back to back, exactly what `data` would
hold. So nothing is joined: the sender hands the kernel its buffers as they are (sendmsg
of the payload tensor's memory, of the stored blocks), the receiver reads them into the
buffer they will live in (one per block on the server, the payload's on the client).

Every length is checked against a limit before anything is allocated for it: a forged
length costs the peer an error, never the receiver its memory. A bad frame (magic,
version, kind, a length over its limit, a message that does not parse) is answered with an
ERROR naming the field (`frame.data_length: ...`) and the connection is closed: the stream
can no longer be trusted to be in step. A refused request (a bad block, a full store, an
unknown lease) is answered with an ERROR and the connection serves on, as over gRPC.

An ERROR's message is the gRPC status name, a newline and the details, so a TCP caller
sees the same codes and messages as a gRPC one. One request at a time per connection.
The server's TCP port travels as gRPC initial metadata of Stats, under TCP_PORT_METADATA.
"""
from __future__ import annotations

import ssl
import struct
from dataclasses import dataclass

import grpc

from pdserve.services.kvstore.errors import InvalidArgument, KVStoreError, from_status

TCP_PORT_METADATA = "pdserve-kvstore-tcp-port"

MAGIC = b"KV"
VERSION = 1
HEADER = struct.Struct("<2sBBIQ")  # magic, version, kind, message length, data length

HELLO, HELLO_OK, PUT_BLOCKS, PUT_END, PUT_REPLY, GET_BLOCKS, BATCH, ERROR = range(1, 9)
KIND_NAMES = {HELLO: "HELLO", HELLO_OK: "HELLO_OK", PUT_BLOCKS: "PUT_BLOCKS", PUT_END: "PUT_END",
              PUT_REPLY: "PUT_REPLY", GET_BLOCKS: "GET_BLOCKS", BATCH: "BATCH", ERROR: "ERROR"}

MAX_TOKEN_BYTES = 1024          # a hello's message: the internal token
MAX_MESSAGE_BYTES = 16 << 20    # headers of ~100k blocks; protobuf parses what is read whole
MAX_ERROR_BYTES = 64 << 10
# A buffer allocated before its bytes arrive is at most this big; a longer run of bytes is
# read in pieces of this size as it arrives, so a forged length costs its sender the bytes
# it actually sends, not the receiver the memory it claims. (A KV block is far smaller:
# 16 tokens of Llama-3-70B in bfloat16 are 5 MiB.)
PREALLOCATE_BYTES = 16 << 20

# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call
_MAX_BUFFERS_PER_SEND = 1024


class BadFrame(Exception):
    """A frame the receiver cannot read on from: answered with `error`, then the connection closes."""

    def __init__(self, error: KVStoreError):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Header:
    kind: int
    message_len: int
    data_len: int

    def check(self, kind_names: tuple[int, ...], max_message: int, max_data: int) -> None:
        """BadFrame naming the field when this frame is not one of `kind_names` or a length
        is above its limit."""
        if self.kind not in kind_names:
            names = " or ".join(KIND_NAMES[k] for k in kind_names)
            raise BadFrame(InvalidArgument("frame.kind", f"{KIND_NAMES.get(self.kind, self.kind)} where {names} "
                                                         "was expected"))
        if self.message_len > max_message:
            raise BadFrame(InvalidArgument("frame.message_length", f"{self.message_len} bytes is above the "
                                                                   f"limit of {max_message}"))
        if self.data_len > max_data:
            raise BadFrame(InvalidArgument("frame.data_length", f"{self.data_len} bytes is above the limit of "
                                                                f"{max_data}"))


def header(kind: int, message_len: int = 0, data_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, message_len, data_len)


def unpack(data) -> Header:
    magic, version, kind, message_len, data_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise BadFrame(InvalidArgument("frame.magic", f"{bytes(magic)!r} is not {MAGIC!r} (not a pdserve KV peer?)"))
    if version != VERSION:
        raise BadFrame(InvalidArgument("frame.version", f"{version}: this peer speaks version {VERSION}"))
    return Header(kind, message_len, data_len)


def frame(kind: int, message=None) -> list:
    """A frame without data: its header and its message, serialized."""
    body = message.SerializeToString() if message is not None else b""
    return [header(kind, len(body)), body]


def error_frame(error: KVStoreError) -> list:
    body = f"{error.code().name}\n{error.details()}".encode()[:MAX_ERROR_BYTES]
    return [header(ERROR, len(body)), body]


def parse_error(data) -> KVStoreError:
    name, _, message = bytes(data).decode(errors="replace").partition("\n")
    code = grpc.StatusCode[name] if name in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    return from_status(code, message)


def parse(data, message_type):
    """A frame's message; one that does not parse is a bad frame."""
    try:
        message = message_type.FromString(data)
    except Exception as e:  # protobuf's DecodeError, raised by its C extension
        raise BadFrame(InvalidArgument("frame.message", f"is not a valid {message_type.DESCRIPTOR.name}: {e}")) from e
    if "data" in message.DESCRIPTOR.fields_by_name and message.data:
        raise BadFrame(InvalidArgument("frame.message", "has its data field set: the bytes follow the message"))
    return message


def recv_exactly(sock, view: memoryview) -> None:
    """Fills `view` from the socket (the GIL is released while the kernel copies);
    ConnectionError when the peer closes first."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionResetError(f"the peer closed the connection {size - got} bytes before the frame's end")
        got += n


def recv_bytes(sock, size: int) -> bytearray:
    """`size` bytes (already checked against a limit), in a buffer of their own; up to
    PREALLOCATE_BYTES read in place, more grown as they arrive."""
    if size <= PREALLOCATE_BYTES:
        return recv_buffer(sock, size)
    data = bytearray()
    while len(data) < size:
        data += recv_buffer(sock, min(PREALLOCATE_BYTES, size - len(data)))
    return data


def recv_buffer(sock, size: int) -> bytearray:
    """`size` bytes read into one buffer allocated first (a length the reader trusts)."""
    data = bytearray(size)
    recv_exactly(sock, memoryview(data))
    return data


def send_all(sock, buffers) -> None:
    """Sends the buffers back to back, as they are: one sendmsg for up to 1024 of them
    (scatter-gather, no join); TLS sockets take one buffer per call instead."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):  # sendmsg is not there: OpenSSL writes its own records
        for view in views:
            sock.sendall(view)
        return
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first:first + _MAX_BUFFERS_PER_SEND])
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]
