"""KV blocks leaving and entering an engine: the prefill exports, the decode imports.

A payload holds a request's KV for its first `num_tokens` tokens, one entry per block, in
the layout of one block on the wire (every layer's K and V of that block, contiguous):

    blocks: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

The last block may be partial (the request's tail block); its unused slots are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler side stays free of torch
    import torch


@dataclass
class KVPayload:
    num_tokens: int
    blocks: "torch.Tensor"
    # hashes of the full blocks (len == num_tokens // block_size), as the engine names them
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]


@dataclass
class KVLoad:
    """For the runner: write `blocks` into the cache blocks `block_ids` before the forward."""
    block_ids: list[int]
    blocks: "torch.Tensor"
