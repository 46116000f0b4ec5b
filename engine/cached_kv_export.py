"""The KV of full blocks the prefix cache still holds, exported by block hash.

A request that finished has freed its blocks, but each full block keeps its prefix-cache
entry until the pool evicts it. A serving worker exports those blocks afterwards (the
decode worker writes a conversation's prompt and answer to the kvstore for its next
turn), naming them by hash, not by request:

    hashes   [h0][h1][h2][h3][h4]
    cached   [b7][b2][--][b9]           h2 evicted since
    export   [b7][b2]                   the leading run only: KV after a gap is unusable
                                        until the gap is filled, so it is not worth moving

Only blocks whose every token's KV was computed are ever cached (a block is registered
when the step that computes its last token is scheduled, and the engine is only asked
between steps), so a request's last sampled token, which has no KV yet, is never in a
cached block. Run this on the engine's thread between steps (it reads the pool and the
cache tensors), never from another thread.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine.kv_transfer import KVPayload

if TYPE_CHECKING:
    import torch

    from pdserve.engine.core.kv_cache_manager import KVCacheManager
    from pdserve.engine.worker.model_runner import ModelRunner


def export_cached_blocks(kv_manager: KVCacheManager, runner: ModelRunner, block_hashes: list[bytes],
                         out: Callable[[int], torch.Tensor | None] = lambda num_blocks: None) -> KVPayload | None:
    """The leading run of `block_hashes` the prefix cache holds, as a KVPayload of full
    blocks (the wire layout); None when it holds not even the first. The blocks are
    copied out, not taken: nothing in the pool changes (no reference, no recency).
    `out(num_blocks)`: the host memory to copy them into, or None (a new tensor)."""
    blocks = kv_manager.find_longest_cache_hit(block_hashes)
    if not blocks:
        return None
    block_ids = [block.block_id for block in blocks]
    return KVPayload(len(blocks) * kv_manager.block_size, runner.export_blocks(block_ids, out(len(block_ids))),
                     list(block_hashes[:len(blocks)]))
