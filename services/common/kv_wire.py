"""KV blocks on the wire: a KVBlockHeader plus the raw bytes of one block.

One block's bytes are [num_layers, 2, block_size, num_kv_heads, head_dim] in its dtype,
exactly a row of the engine's KVPayload.blocks, so packing is a view and no copy of the
tensor layout is needed on either side.
"""
from __future__ import annotations

import torch

from engine.kv_transfer import KVPayload
from services.pb import kvstore_pb2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def block_to_proto(block: torch.Tensor, num_tokens: int, block_hash: bytes = b"",
                   tail_key: str = "") -> kvstore_pb2.KVBlock:
    header = kvstore_pb2.KVBlockHeader(block_hash=block_hash, tail_key=tail_key,
                                       dtype=DTYPE_NAMES[block.dtype], shape=list(block.shape),
                                       layer_start=0, layer_end=block.shape[0], num_tokens=num_tokens)
    data = block.contiguous().view(torch.uint8).numpy().tobytes()
    return kvstore_pb2.KVBlock(header=header, data=data, found=True)


def block_from_proto(msg: kvstore_pb2.KVBlock) -> torch.Tensor:
    header = msg.header
    if header.dtype not in DTYPES:
        raise ValueError(f"KV block dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[header.dtype]
    expected = torch.Size(header.shape).numel() * torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != expected:
        raise ValueError(f"KV block has {len(msg.data)} bytes, its header says {expected}")
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

