"""KV blocks leaving and entering an engine: the prefill exports, the decode imports.

A payload holds a request's KV for its first `num_tokens` tokens, one entry per block, in
the layout of one block on the wire (every layer's K and V of that block, contiguous):

    blocks: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

The last block may be partial (the request's tail block); its unused slots are ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.block_hash import kv_layout_fingerprint
from engine.dtypes import DTYPE_SIZES

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
    blocks: "torch.Tensor"
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


@dataclass
class KVLoad:
    """For the runner: write `blocks` into the cache blocks `block_ids` before the forward."""
    block_ids: list[int]
    blocks: "torch.Tensor"
