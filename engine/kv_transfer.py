"""KV blocks leaving and entering an engine: the prefill exports, the decode imports.

A payload holds a request's KV for its first `num_tokens` tokens, one entry per block, in
the layout of one block on the wire (every layer's K and V of that block, contiguous):

    blocks: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

The last block may be partial (the request's tail block); its unused slots are ignored.
`blocks` is a tensor, or BlockChunks: consecutive runs of blocks as a transport received
them, copied into the cache run by run, never joined first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.core.block_hash import kv_layout_fingerprint
from pdserve.engine.dtypes import DTYPE_SIZES

if TYPE_CHECKING:  # the scheduler side stays free of torch
    import torch


@dataclass(frozen=True)
class KVLayout:
    """What every KV block of one engine is. A block that comes from elsewhere (the kvstore)
    enters the cache only when its header says exactly this (services/worker/kv_integrity.py)."""
    model_id: str
    dtype: str                     # as engine.dtypes names it: "float32", ...
    block_shape: tuple[int, ...]   # [num_layers, 2, block_size, num_kv_heads, head_dim]
    fingerprint: bytes             # the root of every block hash (engine/core/block_hash.py)

    @classmethod
    def of(cls, model_id: str, dtype: str, block_shape: tuple[int, ...]) -> KVLayout:
        """The layout of `model_id`'s blocks in `dtype`, its fingerprint computed."""
        block_shape = tuple(block_shape)
        return cls(model_id, dtype, block_shape, kv_layout_fingerprint(model_id, dtype, block_shape))

    @property
    def block_size(self) -> int:
        return self.block_shape[2]

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * DTYPE_SIZES[self.dtype]


@dataclass
class KVPayload:
    """A request's KV up to token `num_tokens`, from block `first_block` on: the blocks
    before it are not carried, the receiver holds them (a reader that already has a
    prefix in its cache fetches only what follows it):

        tokens   [ b0 ][ b1 ][ b2 ][ b3 ][ tail ]      num_tokens
        held     [ b0 ][ b1 ]                           the receiver's prefix cache
        carried              [ b2 ][ b3 ][ tail ]      first_block = 2, blocks[0] is b2
    """
    num_tokens: int
    blocks: "torch.Tensor | BlockChunks"
    # hashes of the carried full blocks (blocks[i] is named block_hashes[i]), as the engine names them
    block_hashes: list[bytes] = field(default_factory=list)
    first_block: int = 0

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def end_block(self) -> int:
        """One past the last full block carried: the leading full blocks it completes (a
        partial tail block is carried but never named by a hash)."""
        return self.first_block + len(self.block_hashes)


class BlockChunks:
    """Blocks [n, *block_shape] held as consecutive chunks, each a tensor of whole blocks.

    A decode worker receives a prompt's KV in batches. Joining them (torch.cat) would
    allocate and fill a fresh buffer as large as the prompt's KV (87 MB for 1,900 tokens of
    SmolLM2 in float32) on the decode worker's own core, only for the engine to copy it
    again into its cache: measured 0.3-0.76 s of that core per long prompt while it serves
    other streams (fresh pages are faulted in one by one). The import copies each chunk
    into its cache blocks instead (engine/worker/kv_cache.py).

    Reads like the joined tensor where a payload is read: shape, dtype, slices of whole
    blocks, contiguous() (the joined copy, for a path that needs one tensor)."""

    def __init__(self, chunks):
        self.chunks = tuple(c for c in chunks if c.shape[0])
        if not self.chunks:
            raise ValueError("BlockChunks: at least one block")
        first = self.chunks[0]
        for c in self.chunks[1:]:
            if c.shape[1:] != first.shape[1:] or c.dtype != first.dtype or c.device != first.device:
                raise ValueError(f"BlockChunks: a chunk of {tuple(c.shape[1:])} {c.dtype} on {c.device} beside "
                                 f"{tuple(first.shape[1:])} {first.dtype} on {first.device}")

    @property
    def shape(self):
        return type(self.chunks[0].shape)((sum(c.shape[0] for c in self.chunks), *self.chunks[0].shape[1:]))

    @property
    def dtype(self):
        return self.chunks[0].dtype

    @property
    def device(self):
        return self.chunks[0].device

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: slice) -> BlockChunks:
        """Blocks start:stop (a slice of whole blocks; steps and other indexes are refused)."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"BlockChunks takes slices of whole blocks, not {index!r}")
        start, stop, _ = index.indices(len(self))
        parts = []
        for offset, c in self.pieces():
            lo, hi = max(start - offset, 0), min(stop - offset, c.shape[0])
            if lo < hi:
                parts.append(c[lo:hi])
        if not parts:
            raise ValueError(f"BlockChunks: blocks {start}:{stop} of {len(self)} is empty")
        return BlockChunks(parts)

    def pieces(self):
        """(first block index, chunk) for each chunk, in order."""
        offset = 0
        for c in self.chunks:
            yield offset, c
            offset += c.shape[0]

    def contiguous(self) -> "torch.Tensor":
        import torch
        return self.chunks[0].contiguous() if len(self.chunks) == 1 else torch.cat(self.chunks)


def as_tensor(blocks: "torch.Tensor | BlockChunks") -> "torch.Tensor":
    """The blocks as one tensor (BlockChunks joined: a copy)."""
    return blocks.contiguous() if isinstance(blocks, BlockChunks) else blocks


@dataclass
class KVLoad:
    """For the runner: write `blocks` into the cache blocks `block_ids` before the forward."""
    block_ids: list[int]
    blocks: "torch.Tensor | BlockChunks"
