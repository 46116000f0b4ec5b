"""Maps requests to KV blocks on top of the BlockPool: prefix hits, allocation, freeing.

A model whose every layer attends a window of W positions never reads a block again once
all its positions are W or more behind the next query (vLLM's sliding-window manager):

    tokens   [b0][b1][b2][b3][b4][b5..      next query at position p
    window                   |<-- W -->|p
    table    [--][--][b2][b3][b4][b5..     b0, b1 go back to the pool; the table keeps a
                                            placeholder there, which no kernel reads

A freed block keeps its prefix-cache entry until the pool evicts it, as any freed block.
A prefill-only request keeps every block: its whole KV is exported at the hand-off.
"""
from __future__ import annotations

from engine.core.block_hash import BlockHash, hash_full_blocks
from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.request import Request, RequestMode

# In a request's table in place of a block freed outside the window; block id 0 in the
# tensors the kernels get, never read (every kernel starts at the window).
WINDOWED_OUT = KVCacheBlock(0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: BlockHash,
                 enable_prefix_caching: bool = True, window: int | None = None):
        """`window`: the attention window when every layer has one (the widest), else None."""
        self.block_size = block_size
        self.window = window
        self._num_windowed_out: dict[str, int] = {}
        self.num_windowed_out_blocks = 0  # freed outside the window, since start
        self.root_hash = root_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # prefix-cache statistics, in tokens
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's first `num_blocks` full-block hashes, extended incrementally."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_full_blocks(self.root_hash, request.all_token_ids[:num_blocks * self.block_size],
                                           self.block_size, parent, len(hashes), request.cache_salt))
        return hashes[:num_blocks]

    def find_longest_cache_hit(self, block_hashes: list[BlockHash]) -> list[KVCacheBlock]:
        hits = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks for a request that has computed nothing yet.

        The last prompt token is always recomputed, since its logits give the next token:
        a fully cached 32-token prompt with block size 16 hits one block, not two. A request
        that skips reading the cache (its prompt's logprobs are wanted) hits nothing.
        """
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.find_longest_cache_hit(self.block_hashes(request, max_hit_blocks))
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = (),
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens; None if blocks run out.

            | computed before | prefix hits        | new tokens this step     |
            |<- req blocks -->|<- new_computed --->|<- newly allocated ------>|
            [b0][b1]          [b2][b3]             [b4][b5.....]

        Full blocks covering tokens up to the end of this step are registered in the
        prefix cache right away: their tokens are known, and within a step every layer
        writes its KV before any attention reads it. `num_lookahead_tokens` (speculative
        drafts) get slots too but are never registered: a rejected draft's KV must not be
        found by anyone (trim() gives back the blocks that only drafts used).
        """
        blocks = self.req_to_blocks.setdefault(request.req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(new_computed_blocks))
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def free_outside_window(self, request: Request) -> int:
        """Give back the request's blocks that no query from its next token on can see;
        returns how many. Call before the request's next step is scheduled."""
        if self.window is None or request.mode == RequestMode.PREFILL_ONLY:
            return 0
        blocks = self.req_to_blocks.get(request.req_id)
        # positions < num_computed - W + 1 are out of every later query's window
        num_dead = max(0, request.num_computed_tokens - self.window + 1) // self.block_size
        start = self._num_windowed_out.get(request.req_id, 0)
        if not blocks or num_dead <= start:
            return 0
        dead = blocks[start:num_dead]
        blocks[start:num_dead] = [WINDOWED_OUT] * len(dead)
        self.pool.free_blocks(reversed(dead))
        self._num_windowed_out[request.req_id] = num_dead
        self.num_windowed_out_blocks += len(dead)
        return len(dead)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request.req_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request, num_full)
        for i in range(start, num_full):
            if blocks[i] is not WINDOWED_OUT:
                self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.req_id] = num_full

    def trim(self, request: Request) -> None:
        """Frees the request's blocks past its computed tokens (after rejected drafts)."""
        blocks = self.req_to_blocks.get(request.req_id)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]

    def num_blocks(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, ()))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        self._num_windowed_out.pop(request.req_id, None)
        self.pool.free_blocks(b for b in reversed(blocks) if b is not WINDOWED_OUT)
