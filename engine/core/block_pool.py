"""The pool of KV cache blocks: allocation, ref counts and the prefix cache map.

Pure Python, no torch: the scheduler and this pool are testable in milliseconds. A cached
block evicted to reuse its slot goes to the host tier (engine/core/host_tier.py; a null
one when offloading is off) before its bytes are overwritten.
"""
from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.core.block_hash import BlockHash
from pdserve.engine.core.host_tier import HostTier, NoHostTier
from pdserve.engine.core.cache_events import KVEventLog, KVEvents, KVTier


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted first.

    Not a deque: a cached free block that gets a prefix hit must leave the middle of the
    queue in O(1), so the blocks themselves carry the links of a doubly linked list.
    Freed blocks go to the tail, so the least recently freed cached block is evicted first.
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        ids, node = [], self._head.next_free
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 host_tier: HostTier | NoHostTier | None = None, kv_events: KVEventLog | None = None):
        """`host_tier` (with the `kv_events` log it writes to): where evicted cached blocks go."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.kv_events = kv_events or KVEventLog()  # what the prefix cache gained and lost (a router's index)
        self.host_tier = host_tier or NoHostTier()

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Take blocks from the head of the free queue, evicting their cached contents."""
        if num_blocks > self.num_free_blocks:
            return None
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail in the
        given order (callers pass a request's blocks tail-first, so its last blocks, the
        least likely to be shared, are evicted first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash. The first holder of a hash keeps it;
        a duplicate block stays uncached and is reused like any other free block."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        self.kv_events.stored(block_hash)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            self.num_evictions += 1
            self.kv_events.removed(block.block_hash)
            self.host_tier.offload(block.block_id, block.block_hash)
        block.block_hash = None

    def take_kv_events(self) -> KVEvents:
        """The prefix cache's changes since the last call, both tiers; a snapshot of every
        cached hash of both instead when the log overflowed in between."""
        events, lost = self.kv_events.drain()
        if lost:
            return KVEvents(snapshot=[(h, KVTier.DEVICE) for h in self.cached_block_hash_to_block]
                            + [(h, KVTier.HOST) for h in self.host_tier.block_hashes()])
        return KVEvents(events)

