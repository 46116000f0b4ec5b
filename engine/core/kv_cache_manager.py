"""Maps requests to KV blocks on top of the BlockPool: prefix hits, allocation, freeing.

A model whose every layer attends a window of W positions never reads a block again once
all its positions are W or more behind the next query (vLLM's sliding-window manager):

    tokens   [b0][b1][b2][b3][b4][b5..      next query at position p
    window                   |<-- W -->|p
    table    [--][--][b2][b3][b4][b5..     b0, b1 go back to the pool; the table keeps a
                                            placeholder there, which no kernel reads

A freed block keeps its prefix-cache entry until the pool evicts it, as any freed block.
A prefill-only request keeps every block: its whole KV is exported at the hand-off.

With a host tier (engine/core/host_tier.py) a prefix lookup goes on where the device's
hits end; blocks found there get new device blocks and are copied back:

    hashes   [h0][h1][h2][h3][h4]
    device   [b5][b2]                  shared by reference count (touch)
    host             [h2][h3]          new blocks b7, b1; slot -> block copies this step
    computed [=========== 4 blocks ===][the rest of the prompt is computed]
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.core.block_hash import BlockHash, hash_full_blocks
from pdserve.engine.core.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.core.host_tier import HostTier, NoHostTier, Offload, Onload
from pdserve.engine.core.cache_events import KVEventLog
from pdserve.engine.request import Request, RequestMode

# In a request's table in place of a block freed outside the window; block id 0 in the
# tensors the kernels get, never read (every kernel starts at the window).
WINDOWED_OUT = KVCacheBlock(0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PrefixHits:
    """A waiting request's cached prefix, from get_computed_blocks for allocate_slots: the
    blocks the device cache holds, then the hashes of the blocks after them on the host."""
    device: list[KVCacheBlock] = field(default_factory=list)
    host: list[BlockHash] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.device) + len(self.host)


NO_HITS = PrefixHits()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: BlockHash,
                 enable_prefix_caching: bool = True, window: int | None = None, num_host_slots: int = 0):
        """`window`: the attention window when every layer has one (the widest), else None.
        `num_host_slots`: blocks the host tier keeps (0: no host tier); needs prefix caching."""
        if num_host_slots and not enable_prefix_caching:
            raise ValueError("kv_offloading_bytes: the host tier keeps evicted prefix-cache blocks; "
                             "it needs enable_prefix_caching")
        self.block_size = block_size
        self.window = window
        self._num_windowed_out: dict[str, int] = {}
        self.num_windowed_out_blocks = 0  # freed outside the window, since start
        self.root_hash = root_hash
        self.enable_prefix_caching = enable_prefix_caching
        kv_events = KVEventLog()
        self.host: HostTier | NoHostTier = HostTier(num_host_slots, kv_events) if num_host_slots else NoHostTier()
        self.pool = BlockPool(num_blocks, enable_prefix_caching, self.host, kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # prefix-cache statistics, in tokens: looked up and found on the device; then, with a
        # host tier, looked up there (what the device missed) and found
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_host_queried_tokens = 0
        self.num_host_hit_tokens = 0

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

    def num_local_blocks(self, block_hashes: list[BlockHash]) -> int:
        """How many leading blocks of `block_hashes` this engine holds, device then host."""
        device = self.find_longest_cache_hit(block_hashes)
        return len(device) + len(self.host.find_run(block_hashes[len(device):]))

    def get_computed_blocks(self, request: Request) -> tuple[PrefixHits, int]:
        """Cached blocks for a request that has computed nothing yet, and their tokens: the
        device's hits, then the host tier's (a query: allocate_slots takes them).

        The last prompt token is always recomputed, since its logits give the next token:
        a fully cached 32-token prompt with block size 16 hits one block, not two. A request
        that skips reading the cache (its prompt's logprobs are wanted) hits nothing.
        """
        if not self.enable_prefix_caching or request.skip_reading_prefix_cache:
            return NO_HITS, 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, max_hit_blocks)
        device = self.find_longest_cache_hit(hashes)
        hits = PrefixHits(device, self.host.find_run(hashes[len(device):]))
        return hits, hits.num_blocks * self.block_size

    def count_lookup(self, request: Request, hits: PrefixHits) -> None:
        """The statistics of a request's first admission (not of a resume after preemption)."""
        num_device_tokens = len(hits.device) * self.block_size
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_device_tokens
        if self.host.num_slots:
            self.num_host_queried_tokens += request.num_tokens - num_device_tokens
            self.num_host_hit_tokens += len(hits.host) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed: PrefixHits = NO_HITS,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens; None if blocks run out.

            | computed before | device hits | host hits  | new tokens this step   |
            |<- req blocks -->|<- touched ->|<----- newly allocated ------------->|
            [b0][b1]          [b2][b3]      [b4][b5]     [b6][b7.....]
                                            ^ copied from their host slots before the forward

        Full blocks covering tokens up to the end of this step are registered in the
        prefix cache right away: their tokens are known, and within a step every layer
        writes its KV before any attention reads it (host hits are copied in before the
        forward). `num_lookahead_tokens` (speculative drafts) get slots too but are never
        registered: a rejected draft's KV must not be found by anyone (trim() gives back
        the blocks that only drafts used).
        """
        blocks = self.req_to_blocks.setdefault(request.req_id, [])
        device_hits, host_hits = new_computed.device, new_computed.host
        num_computed = request.num_computed_tokens + new_computed.num_blocks * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(device_hits))
        num_free_hits = sum(1 for b in device_hits if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(device_hits)
        blocks.extend(device_hits)
        self.host.pin(host_hits)  # the new blocks' evictions offload into the host tier: keep the hits
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        self.host.onload(host_hits, [b.block_id for b in new_blocks[:len(host_hits)]])
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def take_host_copies(self) -> tuple[list[Offload], list[Onload]]:
        """The block copies between device and host that this step's allocations made."""
        return self.host.take_copies()

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
