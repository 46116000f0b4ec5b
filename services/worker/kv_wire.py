"""KV blocks on the wire: a KVBlockHeader per block plus the raw bytes of each.

One block's bytes are [num_layers, 2, block_size, num_kv_heads, head_dim] in its dtype,
exactly a row of the engine's KVPayload.blocks. A payload is therefore written as its
headers plus the payload tensor's own memory (rows back to back, no copy per block), and
read back as tensors viewing the bytes where the transport received them:

    KVPayload.blocks  [n, layers, 2, bs, heads, dim]  ──put_blocks──▶ sealed headers + one buffer
    get_blocks ──▶ KVBlockBatch (headers, found, data) ... ──checked──▶ torch.frombuffer(data): [k, ...]
                                                                        one per batch, as BlockChunks

Every header names the model (fingerprint, id) and carries a checksum over itself and the
block's bytes; a reader uses a block only when it passes kv_integrity's checks. With the
platform's keys (services/worker/kv_seal.py) the bytes on the wire are ciphertext: the
writer encrypts into a buffer of its own, the reader decrypts into one (the view above is
then of that buffer) and only once its seal holds.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.dtypes import DTYPE_NAMES, DTYPE_SIZES, dtype_name, torch_dtype
from pdserve.engine.kv_transfer import BlockChunks, KVLayout, KVPayload
from pdserve.services.kvstore.batch_codec import Decoded
from pdserve.services.kvstore.transports.reused_buffers import ReusedBuffers
from pdserve.services.pb import kvstore_pb2
from pdserve.services.worker.kv_integrity import refusal, seal, seal_encrypted, stamp
from pdserve.services.worker.kv_seal import KVKeys


# Where sealed blocks are encrypted into and opened blocks decrypted into (AES-GCM cannot
# work in place): buffers reused once nothing views them. Fresh memory of a payload's size
# would cost a page fault per 4 KiB, more than the cipher (kvstore/transports/reused_buffers.py).
_SEALED = ReusedBuffers(8)   # a put's ciphertext: free again once the put has sent it
_OPENED = ReusedBuffers(16)  # a read's plain blocks: free again once the engine copied them in


def block_header(block_shape, dtype: torch.dtype, num_tokens: int, block_hash: bytes = b"",
                 tail_key: str = "", layout: KVLayout | None = None) -> kvstore_pb2.KVBlockHeader:
    """A block's header; with `layout`, naming the model it belongs to (not sealed yet)."""
    header = kvstore_pb2.KVBlockHeader(block_hash=block_hash, tail_key=tail_key, dtype=dtype_name(dtype),
                                       shape=list(block_shape), layer_start=0, layer_end=block_shape[0],
                                       num_tokens=num_tokens)
    return stamp(header, layout) if layout is not None else header


def block_to_proto(block: torch.Tensor, num_tokens: int, block_hash: bytes = b"", tail_key: str = "",
                   model_id: str = "pdserve-tools") -> kvstore_pb2.KVBlock:
    """One block as one sealed KVBlock message (the simple Put, for tools and tests; the
    workers use put_blocks), as a model called `model_id` would write it."""
    data = block.contiguous().view(torch.uint8).numpy().tobytes()
    layout = KVLayout.of(model_id, dtype_name(block.dtype), tuple(block.shape))
    header = block_header(block.shape, block.dtype, num_tokens, block_hash, tail_key, layout)
    return kvstore_pb2.KVBlock(header=seal(header, data), data=data, found=True)


def block_from_proto(msg: kvstore_pb2.KVBlock) -> torch.Tensor:
    header = msg.header
    expected = torch.Size(header.shape).numel() * DTYPE_SIZES.get(header.dtype, 0)
    if len(msg.data) != expected:
        raise ValueError(f"KV block has {len(msg.data)} bytes, its header says {expected}")
    if header.dtype not in DTYPE_NAMES:
        raise ValueError(f"KV block dtype {header.dtype!r} is not one of {sorted(DTYPE_NAMES)}")
    return _view(msg.data, torch_dtype(header.dtype), tuple(header.shape), 1)[0]


def payload_to_put(payload: KVPayload, layout: KVLayout, tail_key: str, skip_blocks: int = 0,
                   keys: KVKeys | None = None, cache_salt: str = "",
                   out: Callable[[int], object] | None = None) -> tuple[list[kvstore_pb2.KVBlockHeader], memoryview]:
    """Sealed headers and bytes for KVStoreClient.put_blocks: full blocks under their
    hashes, the partial last one (if any) under `tail_key`. The first `skip_blocks` full
    blocks (already in the store) are left out. Without `keys` the bytes are the payload
    tensor's own memory, each block's checksum reading them in place; with them, the
    ciphertext for `cache_salt`, in `out(nbytes)` (e.g. the transport's export memory,
    KVStoreClient.export_buffer) or, where that gives None, a reused buffer of this module's
    (the write is off the first token)."""
    block_size = layout.block_size
    num_full = payload.num_tokens // block_size
    shape, dtype = payload.blocks.shape[1:], payload.blocks.dtype
    headers = [block_header(shape, dtype, block_size, payload.block_hashes[i], layout=layout)
               for i in range(skip_blocks, num_full)]
    if payload.num_tokens % block_size:
        headers.append(block_header(shape, dtype, payload.num_tokens % block_size, tail_key=tail_key, layout=layout))
    rows = payload.blocks[skip_blocks:skip_blocks + len(headers)].contiguous()
    data = _bytes_of(rows.view(torch.uint8))
    nbytes = layout.block_nbytes
    if keys is None:
        for i, header in enumerate(headers):
            seal(header, data[i * nbytes:(i + 1) * nbytes])
        return headers, data
    given = out(len(data)) if out is not None and len(data) else None
    sealed = memoryview(given).cast("B") if given is not None else _SEALED.take(len(data))
    for i, header in enumerate(headers):
        part = slice(i * nbytes, (i + 1) * nbytes)
        seal_encrypted(header, data[part], sealed[part], keys, cache_salt)
    return headers, sealed


@dataclass
class KVRead:
    """What a read from the kvstore gave: the usable leading blocks, and why the block after
    them was refused (None: it was missing, or every block asked for was used)."""
    payload: KVPayload | None
    refused: str | None = None


def payload_from_batches(batches: list[Decoded], block_hashes: list[bytes], layout: KVLayout,
                         tail_key: str = "", tail_tokens: int = 0, first_block: int = 0,
                         keys: KVKeys | None = None, cache_salt: str = "") -> KVRead:
    """A kvstore's get_blocks answer for `block_hashes` (then `tail_key`, holding
    `tail_tokens` tokens, if set) as a KVPayload of the leading blocks that arrived and
    pass kv_integrity's checks:

        asked:  [h0][h1][h2][h3][tail]
        found:  [h0][h1][--][h3][tail]            ->  h0, h1: 2 * block_size tokens
        found:  [h0][h1][h2][h3][tail], h1 forged ->  h0 (h1 refused, with its reason)

    A gap or a refused block ends the usable prefix (KV is only valid after every token
    before it); the tail counts only when every full block before it was usable. The
    bytes are viewed where the transport received them: checked in place, no copy; with
    `keys`, decrypted for `cache_salt` into one buffer per batch, and that is viewed.
    `first_block`: the request's index of the first block asked for (the reader holds
    the ones before it); the payload covers the tokens up to its last usable block.
    """
    asked = [(h, "") for h in block_hashes] + ([(b"", tail_key)] if tail_key else [])
    nbytes, parts, num_used, refused = layout.block_nbytes, [], 0, None
    for batch in batches:
        take = 0
        plain = batch.data if keys is None else _OPENED.take(len(batch.message.found) * nbytes)
        for header, found in zip(batch.message.headers, batch.message.found):
            if num_used + take == len(asked) or not found:
                break
            block_hash, tail = asked[num_used + take]
            out = None if keys is None else plain[take * nbytes:(take + 1) * nbytes]
            refused = refusal(header, batch.data[take * nbytes:], layout, block_hash, tail, tail_tokens, keys, out,
                              cache_salt)
            if refused is not None:
                break
            take += 1
        if take:
            parts.append(_view(plain, torch_dtype(layout.dtype), layout.block_shape, take))
        num_used += take
        if take < len(batch.message.found) or num_used == len(asked):
            break
    if num_used == 0:
        return KVRead(None, refused)
    num_full = min(num_used, len(block_hashes))
    covered = (first_block + num_full) * layout.block_size + (tail_tokens if num_used > len(block_hashes) else 0)
    blocks = parts[0] if len(parts) == 1 else BlockChunks(parts)  # never joined: see BlockChunks
    return KVRead(KVPayload(covered, blocks, list(block_hashes[:num_full]), first_block), refused)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous uint8 tensor's memory as bytes (shared, writable)."""
    return memoryview(tensor.numpy()).cast("B")


def _view(data, dtype: torch.dtype, block_shape: tuple[int, ...], count: int) -> torch.Tensor:
    """`count` blocks of `block_shape` viewing the first bytes of `data`, no copy (the
    caller checked there are that many). The view may be read-only (gRPC hands over
    immutable bytes): the engine only reads an imported payload (it copies it into its
    cache), so torch's warning about writing to such a buffer is silenced here."""
    per_block = math.prod(block_shape) * dtype.itemsize
    view = memoryview(data).cast("B")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(view, dtype=torch.uint8, count=count * per_block)
    return raw.view(dtype).reshape(count, *block_shape)
