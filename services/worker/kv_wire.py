"""KV blocks on the wire: a KVBlockHeader plus the raw bytes of one block.

One block's bytes are [num_layers, 2, block_size, num_kv_heads, head_dim] in its dtype,
exactly a row of the engine's KVPayload.blocks, so packing is a view and no copy of the
tensor layout is needed on either side.
"""
from __future__ import annotations

import torch

from engine.dtypes import DTYPE_NAMES, DTYPE_SIZES, dtype_name, torch_dtype
from engine.kv_transfer import KVPayload
from services.pb import kvstore_pb2


def block_to_proto(block: torch.Tensor, num_tokens: int, block_hash: bytes = b"",
                   tail_key: str = "") -> kvstore_pb2.KVBlock:
    header = kvstore_pb2.KVBlockHeader(block_hash=block_hash, tail_key=tail_key,
                                       dtype=dtype_name(block.dtype), shape=list(block.shape),
                                       layer_start=0, layer_end=block.shape[0], num_tokens=num_tokens)
    data = block.contiguous().view(torch.uint8).numpy().tobytes()
    return kvstore_pb2.KVBlock(header=header, data=data, found=True)


def block_from_proto(msg: kvstore_pb2.KVBlock) -> torch.Tensor:
    header = msg.header
    if header.dtype not in DTYPE_NAMES:
        raise ValueError(f"KV block dtype {header.dtype!r} is not one of {sorted(DTYPE_NAMES)}")
    expected = torch.Size(header.shape).numel() * DTYPE_SIZES[header.dtype]
    if len(msg.data) != expected:
        raise ValueError(f"KV block has {len(msg.data)} bytes, its header says {expected}")
    dtype = torch_dtype(header.dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(tuple(header.shape))


def payload_to_protos(payload: KVPayload, block_size: int, tail_key: str,
                      skip_blocks: int = 0) -> list[kvstore_pb2.KVBlock]:
    """Full blocks under their hashes, the partial last one (if any) under `tail_key`.
    The first `skip_blocks` full blocks (already in the store) are left out."""
    num_full = payload.num_tokens // block_size
    msgs = [block_to_proto(payload.blocks[i], block_size, block_hash=payload.block_hashes[i])
            for i in range(skip_blocks, num_full)]
    if payload.num_tokens % block_size:
        msgs.append(block_to_proto(payload.blocks[num_full], payload.num_tokens % block_size, tail_key=tail_key))
    return msgs


def payload_from_protos(blocks: list[kvstore_pb2.KVBlock], block_hashes: list[bytes], block_size: int,
                        num_tokens: int) -> KVPayload | None:
    """The inverse of payload_to_protos for a kvstore answer: the leading blocks it found.

        asked:  [h0][h1][h2][h3][tail]      (num_tokens covers all of them)
        found:  [h0][h1][--][h3][tail]  ->  KVPayload of h0, h1: 2 * block_size tokens

    A gap ends the usable prefix (KV is only valid after every token before it); the
    tail counts only when every full block before it arrived. None when nothing did.
    """
    usable = 0
    while usable < len(blocks) and blocks[usable].found:
        usable += 1
    if usable == 0:
        return None
    num_full = min(usable, len(block_hashes))
    covered = num_tokens if usable == len(blocks) else num_full * block_size
    tensors = torch.stack([block_from_proto(b) for b in blocks[:usable]])
    return KVPayload(covered, tensors, list(block_hashes[:num_full]))
