"""From wire messages to store keys and blocks, refusing bad input with the field's name.

The store keeps a block's bytes opaque, but checks them against the header here: a
block whose data does not match shape × dtype size would fail in the decode worker much
later, far from the prefill that wrote it.
"""
from __future__ import annotations

import math

from engine.dtypes import DTYPE_SIZES
from services.kvstore.errors import InvalidArgument
from services.kvstore.store import StoredBlock, hash_key, tail_key
from services.pb import kvstore_pb2

MAX_HASH_BYTES = 64     # sha256 is 32, xxh128 16: anything longer is not a block hash
MAX_TAIL_KEY_BYTES = 512
MAX_SHAPE_DIMS = 8


def key_for_hash(block_hash: bytes, field: str) -> bytes:
    if not block_hash:
        raise InvalidArgument(field, "is empty")
    if len(block_hash) > MAX_HASH_BYTES:
        raise InvalidArgument(field, f"is {len(block_hash)} bytes, at most {MAX_HASH_BYTES}")
    return hash_key(block_hash)


def key_for_tail(key: str, field: str) -> bytes:
    if not key:
        raise InvalidArgument(field, "is empty")
    if len(key.encode()) > MAX_TAIL_KEY_BYTES:
        raise InvalidArgument(field, f"is longer than {MAX_TAIL_KEY_BYTES} bytes")
    return tail_key(key)


def stored_block(block: kvstore_pb2.KVBlock, field: str) -> StoredBlock:
    """`field` names the block in the request, e.g. "put[3].block"."""
    header = block.header
    if bool(header.block_hash) == bool(header.tail_key):
        raise InvalidArgument(f"{field}.header.block_hash", "exactly one of block_hash and tail_key must be set")
    key = (key_for_hash(header.block_hash, f"{field}.header.block_hash") if header.block_hash
           else key_for_tail(header.tail_key, f"{field}.header.tail_key"))
    expected = _expected_bytes(header, f"{field}.header")
    if len(block.data) != expected:
        raise InvalidArgument(f"{field}.data", f"has {len(block.data)} bytes, its header says {expected} "
                                               f"(shape {list(header.shape)} x {header.dtype})")
    return StoredBlock(key, header.SerializeToString(), block.data)


def stored_blocks(headers, data: memoryview, field: str) -> list[StoredBlock]:
    """A PutBlocksRequest's blocks: `data` cut by the headers' sizes, in order, no copy.
    `field` names the message, e.g. "put[2]"."""
    blocks, offset = [], 0
    for i, header in enumerate(headers):
        name = f"{field}.headers[{i}]"
        if bool(header.block_hash) == bool(header.tail_key):
            raise InvalidArgument(f"{name}.block_hash", "exactly one of block_hash and tail_key must be set")
        key = (key_for_hash(header.block_hash, f"{name}.block_hash") if header.block_hash
               else key_for_tail(header.tail_key, f"{name}.tail_key"))
        size = _expected_bytes(header, name)
        blocks.append(StoredBlock(key, header.SerializeToString(), data[offset:offset + size]))
        offset += size
    if offset != len(data):
        raise InvalidArgument(f"{field}.data", f"has {len(data)} bytes, its headers say {offset}")
    return blocks


def block_nbytes(header: kvstore_pb2.KVBlockHeader) -> int:
    """The bytes of a block with this header; 0 for an unknown dtype (the store refuses
    such a block with the field named)."""
    return math.prod(header.shape) * DTYPE_SIZES.get(header.dtype, 0)


def _expected_bytes(header: kvstore_pb2.KVBlockHeader, field: str) -> int:
    if header.dtype not in DTYPE_SIZES:
        raise InvalidArgument(f"{field}.dtype", f"{header.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    shape = list(header.shape)
    if not shape or len(shape) > MAX_SHAPE_DIMS or 0 in shape:
        raise InvalidArgument(f"{field}.shape", f"{shape} must have 1 to {MAX_SHAPE_DIMS} dimensions, none 0")
    if header.layer_end <= header.layer_start:
        raise InvalidArgument(f"{field}.layer_end", f"{header.layer_end} must be above layer_start "
                                                    f"{header.layer_start}")
    if shape[0] != header.layer_end - header.layer_start:
        raise InvalidArgument(f"{field}.shape", f"first dimension {shape[0]} must be the layer count "
                                                f"layer_end - layer_start = {header.layer_end - header.layer_start}")
    if header.num_tokens == 0:
        raise InvalidArgument(f"{field}.num_tokens", "is 0: a block holds at least one token")
    return math.prod(shape) * DTYPE_SIZES[header.dtype]


def to_wire(block: StoredBlock) -> kvstore_pb2.KVBlock:
    return kvstore_pb2.KVBlock(header=kvstore_pb2.KVBlockHeader.FromString(block.header), data=block.data,
                               found=True)


def missing(block_hash: bytes = b"", key: str = "") -> kvstore_pb2.KVBlock:
    """A Get answer for a block the store does not hold: found=False, named in its header."""
    return kvstore_pb2.KVBlock(header=kvstore_pb2.KVBlockHeader(block_hash=block_hash, tail_key=key), found=False)
