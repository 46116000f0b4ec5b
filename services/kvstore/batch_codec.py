"""PutBlocksRequest and KVBlockBatch on the wire without copying their block bytes through
protobuf.

Both messages end in one large `bytes` field (`data`, field 15) holding many blocks back
to back. Protobuf's Python API would copy it several times (into the message, out at
every `.data` access, into the serialization). Its wire format is simple enough to do
better: a message is a sequence of (tag, value) fields in any order, so

    encode:  [the message without data, serialized by protobuf][tag 15][length][buffers...]

is the message's valid encoding, built with one join straight from the senders' buffers
(a tensor's memory, stored block bytes); and

    decode:  walk the top-level fields, view `data` in place (a memoryview of the received
             bytes), let protobuf parse the rest (headers: tens of bytes per block)

Any protobuf library reads what encode writes and writes what decode reads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import Message

from pdserve.services.kvstore.errors import InvalidArgument

DATA_FIELD = 15  # `data` in PutBlocksRequest and KVBlockBatch
# Block bytes per KVBlockBatch of a GetBlocks answer. Large enough that per-message costs
# vanish (a few headers, one join), small enough that sender and receiver overlap (a batch
# is on the wire while the next is built), far below the 256 MiB gRPC message limit, and
# below glibc's largest dynamic mmap threshold (32 MiB), so a freed buffer's memory is
# reused for the next one instead of being faulted in afresh.
BATCH_BYTES = 16 << 20
_LEN = 2         # wire type of a length-delimited field


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_DATA_TAG = _varint(DATA_FIELD << 3 | _LEN)


def encode(message: Message, buffers: Sequence, prefix: bytes = b"") -> bytes:
    """`prefix` (e.g. a UCX frame's kind byte), then `message` (its data field unset) with
    `data` = the buffers concatenated. Buffers: anything with the buffer protocol,
    C-contiguous (bytes, memoryview, a numpy view of a tensor)."""
    views = [memoryview(b).cast("B") for b in buffers]
    size = sum(v.nbytes for v in views)
    return b"".join([prefix, message.SerializeToString(), _DATA_TAG, _varint(size), *views])


@dataclass
class OutBatch:
    """A message to send with its data field made of `buffers` (sent as they are)."""
    message: Message
    buffers: list

    @property
    def num_bytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.buffers)

    def encode(self, prefix: bytes = b"") -> bytes:
        return encode(self.message, self.buffers, prefix)


@dataclass
class Decoded:
    message: Message     # every field but data
    data: memoryview     # a view into the received bytes: no copy
    error: InvalidArgument | None = None  # set instead of raising, where a caller cannot raise


def decode(buffer, message_type: type[Message], offset: int = 0) -> Decoded:
    """The inverse of encode, from `offset` on. A malformed message is the sender's
    error (InvalidArgument naming "frame")."""
    view = memoryview(buffer).cast("B")[offset:]
    rest, data, pos = [], view[:0], 0
    try:
        while pos < len(view):
            start = pos
            key, pos = _read_varint(view, pos)
            field, wire = key >> 3, key & 7
            end = _skip(view, pos, wire)
            if field == DATA_FIELD and wire == _LEN:
                data = view[_read_varint(view, pos)[1]:end]  # the last one wins, as in protobuf
            else:
                rest.append(view[start:end])
            pos = end
        if pos != len(view):
            raise ValueError("a field runs past the end")
        message = message_type.FromString(b"".join(rest))
    except (ValueError, IndexError) as e:
        raise InvalidArgument("frame", f"is not a valid {message_type.DESCRIPTOR.name}: {e}") from None
    except Exception as e:  # protobuf's DecodeError, raised by its C extension
        raise InvalidArgument("frame", f"is not a valid {message_type.DESCRIPTOR.name}: {e}") from e
    return Decoded(message, data)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def _skip(view: memoryview, pos: int, wire: int) -> int:
    """The position after a field's value that starts at `pos`."""
    if wire == 0:
        return _read_varint(view, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 5:
        return pos + 4
    if wire == _LEN:
        length, pos = _read_varint(view, pos)
        return pos + length
    raise ValueError(f"wire type {wire} is not supported")
