"""From wire messages to store keys and blocks, refusing bad input with the field's name.

The store keeps a block's bytes opaque, but refuses a block whose header is not one a
pdserve engine writes (issue 14): a hash that is not a block hash, a dtype, shape, layer
range or token count that is not a KV block's, a model fingerprint that disagrees with the
header's model id, dtype and shape (engine/core/block_hash.kv_layout_fingerprint), no
checksum, or bytes that do not match shape x dtype size. Such a block would otherwise fail
in a decode worker much later, far from whoever wrote it. The checksum itself is the
reader's to verify (services/worker/kv_integrity.py): the store does not read the bytes.
"""
from __future__ import annotations

import math

from pdserve.engine.core.block_hash import BLOCK_HASH_BYTES, kv_layout_fingerprint
from pdserve.engine.dtypes import DTYPE_SIZES
from pdserve.services.kvstore.errors import InvalidArgument
from pdserve.services.kvstore.stores.base import StoredBlock, hash_key, tail_key
from pdserve.services.pb import kvstore_pb2

MAX_TAIL_KEY_BYTES = 512
MAX_MODEL_ID_BYTES = 512
# [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
BLOCK_SHAPE_DIMS = ("num_layers", "K and V", "block_size", "num_kv_heads", "head_dim")


def key_for_hash(block_hash: bytes, field: str) -> bytes:
    if len(block_hash) != BLOCK_HASH_BYTES:
        raise InvalidArgument(field, f"is {len(block_hash)} bytes; a block hash is {BLOCK_HASH_BYTES}")
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
    key, expected = _checked_header(header, f"{field}.header")
    if len(block.data) != expected:
        raise InvalidArgument(f"{field}.data", f"has {len(block.data)} bytes, its header says {expected} "
                                               f"(shape {list(header.shape)} x {header.dtype})")
    return StoredBlock(key, header.SerializeToString(), block.data)


def stored_blocks(headers, data: memoryview, field: str) -> list[StoredBlock]:
    """A PutBlocksRequest's blocks: `data` cut by the headers' sizes, in order, no copy.
    `field` names the message, e.g. "put[2]"."""
    blocks, offset = [], 0
    for i, header in enumerate(headers):
        key, size = _checked_header(header, f"{field}.headers[{i}]")
        blocks.append(StoredBlock(key, header.SerializeToString(), data[offset:offset + size]))
        offset += size
    if offset != len(data):
        raise InvalidArgument(f"{field}.data", f"has {len(data)} bytes, its headers say {offset}")
    return blocks


def indexed_blocks(headers, data: memoryview, field: str) -> list[StoredBlock]:
    """A PutBlocksRequest's blocks whose bytes are in the data plane: index entries of
    the size their headers give. `data` must be empty."""
    if len(data):
        raise InvalidArgument(f"{field}.data", f"has {len(data)} bytes, but bytes_in_data_plane is set")
    blocks = []
    for i, header in enumerate(headers):
        key, size = _checked_header(header, f"{field}.headers[{i}]")
        blocks.append(StoredBlock(key, header.SerializeToString(), b"", size=size))
    return blocks


def _checked_header(header: kvstore_pb2.KVBlockHeader, field: str) -> tuple[bytes, int]:
    """The block's store key and byte size; InvalidArgument naming what is wrong."""
    if bool(header.block_hash) == bool(header.tail_key):
        raise InvalidArgument(f"{field}.block_hash", "exactly one of block_hash and tail_key must be set")
    key = (key_for_hash(header.block_hash, f"{field}.block_hash") if header.block_hash
           else key_for_tail(header.tail_key, f"{field}.tail_key"))
    size = _expected_bytes(header, field)
    _check_model(header, field)
    if not header.HasField("checksum"):
        raise InvalidArgument(f"{field}.checksum", "is missing: the writer seals every block")
    return key, size


def _check_model(header: kvstore_pb2.KVBlockHeader, field: str) -> None:
    """The fingerprint the block claims must be the one its model id, dtype and shape give:
    a block cannot claim to be a model's while having another layout."""
    if not header.model_id or len(header.model_id.encode()) > MAX_MODEL_ID_BYTES:
        raise InvalidArgument(f"{field}.model_id", f"must be 1 to {MAX_MODEL_ID_BYTES} bytes, "
                                                   f"got {len(header.model_id.encode())}")
    if len(header.model_fingerprint) != BLOCK_HASH_BYTES:
        raise InvalidArgument(f"{field}.model_fingerprint", f"is {len(header.model_fingerprint)} bytes; "
                                                            f"a fingerprint is {BLOCK_HASH_BYTES}")
    if header.model_fingerprint != kv_layout_fingerprint(header.model_id, header.dtype, tuple(header.shape)):
        raise InvalidArgument(f"{field}.model_fingerprint", f"is not the fingerprint of model {header.model_id!r} "
                                                            f"with {header.dtype} blocks of shape {list(header.shape)}")


def block_nbytes(header: kvstore_pb2.KVBlockHeader) -> int:
    """The bytes of a block with this header; 0 for an unknown dtype (the store refuses
    such a block with the field named)."""
    return math.prod(header.shape) * DTYPE_SIZES.get(header.dtype, 0)


def _expected_bytes(header: kvstore_pb2.KVBlockHeader, field: str) -> int:
    if header.dtype not in DTYPE_SIZES:
        raise InvalidArgument(f"{field}.dtype", f"{header.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
    shape = list(header.shape)
    if len(shape) != len(BLOCK_SHAPE_DIMS) or 0 in shape or shape[1] != 2:
        raise InvalidArgument(f"{field}.shape", f"{shape} is not a KV block's [{', '.join(BLOCK_SHAPE_DIMS)}] "
                                                "(5 dimensions, none 0, the second 2)")
    if header.layer_start != 0 or header.layer_end != shape[0]:
        raise InvalidArgument(f"{field}.layer_end", f"layers [{header.layer_start}, {header.layer_end}) must be "
                                                    f"all of the block's {shape[0]}: [0, {shape[0]})")
    block_size = shape[2]
    if not 0 < header.num_tokens <= block_size or (header.block_hash and header.num_tokens != block_size):
        raise InvalidArgument(f"{field}.num_tokens", f"is {header.num_tokens}: a full block holds block_size "
                                                     f"({block_size}) tokens, a tail 1 to {block_size}")
    return math.prod(shape) * DTYPE_SIZES[header.dtype]


def to_wire(block: StoredBlock) -> kvstore_pb2.KVBlock:
    # protobuf takes bytes only: a block PutBlocks stored is a view into its message
    data = block.data if isinstance(block.data, bytes) else bytes(block.data)
    return kvstore_pb2.KVBlock(header=kvstore_pb2.KVBlockHeader.FromString(block.header), data=data, found=True)


def missing(block_hash: bytes = b"", key: str = "") -> kvstore_pb2.KVBlock:
    """A Get answer for a block the store does not hold: found=False, named in its header."""
    return kvstore_pb2.KVBlock(header=kvstore_pb2.KVBlockHeader(block_hash=block_hash, tail_key=key), found=False)
