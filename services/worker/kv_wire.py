"""KV blocks on the wire: a KVBlockHeader per block plus the raw bytes of each.

One block's bytes are [num_layers, 2, block_size, num_kv_heads, head_dim] in its dtype,
exactly a row of the engine's KVPayload.blocks. A payload is therefore written as its
headers plus the payload tensor's own memory (rows back to back, no copy per block), and
read back as tensors viewing the bytes where the transport received them:

    KVPayload.blocks  [n, layers, 2, bs, heads, dim]  ──put_blocks──▶ headers + one buffer
    get_blocks ──▶ KVBlockBatch (headers, found, data) ... ──▶ torch.frombuffer(data): [k, ...]
"""
from __future__ import annotations

import warnings

import torch

from engine.dtypes import DTYPE_NAMES, DTYPE_SIZES, dtype_name, torch_dtype
from engine.kv_transfer import KVPayload
from services.kvstore.batch_codec import Decoded
from services.pb import kvstore_pb2


def block_header(block_shape, dtype: torch.dtype, num_tokens: int, block_hash: bytes = b"",
                 tail_key: str = "") -> kvstore_pb2.KVBlockHeader:
    return kvstore_pb2.KVBlockHeader(block_hash=block_hash, tail_key=tail_key, dtype=dtype_name(dtype),
                                     shape=list(block_shape), layer_start=0, layer_end=block_shape[0],
                                     num_tokens=num_tokens)


def block_to_proto(block: torch.Tensor, num_tokens: int, block_hash: bytes = b"",
                   tail_key: str = "") -> kvstore_pb2.KVBlock:
    """One block as one KVBlock message (the simple Put; the workers use put_blocks)."""
    data = block.contiguous().view(torch.uint8).numpy().tobytes()
    return kvstore_pb2.KVBlock(header=block_header(block.shape, block.dtype, num_tokens, block_hash, tail_key),
                               data=data, found=True)


def block_from_proto(msg: kvstore_pb2.KVBlock) -> torch.Tensor:
    header = msg.header
    expected = torch.Size(header.shape).numel() * DTYPE_SIZES.get(header.dtype, 0)
    if len(msg.data) != expected:
        raise ValueError(f"KV block has {len(msg.data)} bytes, its header says {expected}")
    return _view(msg.data, header, 1)[0]


def payload_to_put(payload: KVPayload, block_size: int, tail_key: str,
                   skip_blocks: int = 0) -> tuple[list[kvstore_pb2.KVBlockHeader], memoryview]:
    """Headers and bytes for KVStoreClient.put_blocks: full blocks under their hashes, the
    partial last one (if any) under `tail_key`. The first `skip_blocks` full blocks
    (already in the store) are left out. The bytes are the payload tensor's own memory."""
    num_full = payload.num_tokens // block_size
    shape, dtype = payload.blocks.shape[1:], payload.blocks.dtype
    headers = [block_header(shape, dtype, block_size, block_hash=payload.block_hashes[i])
               for i in range(skip_blocks, num_full)]
    if payload.num_tokens % block_size:
        headers.append(block_header(shape, dtype, payload.num_tokens % block_size, tail_key=tail_key))
    rows = payload.blocks[skip_blocks:skip_blocks + len(headers)].contiguous()
    return headers, memoryview(rows.view(torch.uint8).numpy()).cast("B")


def payload_from_batches(batches: list[Decoded], block_hashes: list[bytes], block_size: int,
                         num_tokens: int) -> KVPayload | None:
    """A kvstore's get_blocks answer as a KVPayload: the leading blocks it found.

        asked:  [h0][h1][h2][h3][tail]      (num_tokens covers all of them)
        found:  [h0][h1][--][h3][tail]  ->  KVPayload of h0, h1: 2 * block_size tokens

    A gap ends the usable prefix (KV is only valid after every token before it); the
    tail counts only when every full block before it arrived. None when nothing did.
    Raises ValueError when the headers disagree with each other or with the bytes.
    """
    found = [f for b in batches for f in b.message.found]
    usable = 0
    while usable < len(found) and found[usable]:
        usable += 1
    if usable == 0:
        return None
    num_full = min(usable, len(block_hashes))
    covered = num_tokens if usable == len(found) else num_full * block_size
    parts, remaining = [], usable
    for batch in batches:
        take = min(remaining, _leading_found(batch.message.found))
        if take:
            parts.append(_view(batch.data, batch.message.headers[0], take, batch.message.headers[:take]))
        remaining -= take
        if remaining == 0:
            break
    blocks = parts[0] if len(parts) == 1 else torch.cat(parts)
    return KVPayload(covered, blocks, list(block_hashes[:num_full]))


def _leading_found(found) -> int:
    n = 0
    while n < len(found) and found[n]:
        n += 1
    return n


def _view(data, header: kvstore_pb2.KVBlockHeader, count: int, headers=()) -> torch.Tensor:
    """`count` blocks of `header`'s shape viewing the first bytes of `data`, no copy.
    The view may be read-only (gRPC hands over immutable bytes): the engine only reads an
    imported payload (it copies it into its cache), so torch's warning about writing to
    such a buffer is silenced here."""
    if header.dtype not in DTYPE_NAMES:
        raise ValueError(f"KV block dtype {header.dtype!r} is not one of {sorted(DTYPE_NAMES)}")
    for other in headers:
        if other.dtype != header.dtype or list(other.shape) != list(header.shape):
            raise ValueError(f"KV blocks of one answer differ: {other.dtype} {list(other.shape)} "
                             f"vs {header.dtype} {list(header.shape)}")
    per_block = torch.Size(header.shape).numel() * DTYPE_SIZES[header.dtype]
    view = memoryview(data).cast("B")
    if len(view) < count * per_block:
        raise ValueError(f"KV blocks have {len(view)} bytes, their headers say at least {count * per_block}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(view, dtype=torch.uint8, count=count * per_block)
    return raw.view(torch_dtype(header.dtype)).reshape(count, *header.shape)
