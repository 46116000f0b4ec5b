"""The in-process BlockStore: one OrderedDict in recency order, one lock.

    least recent ──────────────────────────────▶ most recent
    [h1 pinned] [h2] [t:a] [h3 pinned] [h4] ...
    eviction scans from the left, skipping pinned blocks and the put's own keys.

Pinned blocks stay in the recency order (a get still refreshes them), so a block that
loses its last pin is evicted in the place its last use earned it. Skipping pins costs a
scan over them; pins are held only by requests in flight between prefill and decode.
"""
from __future__ import annotations

import heapq
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from services.kvstore.errors import LeaseNotFound
from services.kvstore.store import NULL_EVENTS, BlockStore, StoredBlock, StoreEvents, StoreStats, is_tail, last_wins


@dataclass
class _Entry:
    block: StoredBlock
    num_pins: int = 0


@dataclass
class _Lease:
    expires_at: float
    pinned_keys: set[bytes] = field(default_factory=set)
    tail_keys: set[bytes] = field(default_factory=set)


class MemoryBlockStore(BlockStore):
    def __init__(self, capacity_bytes: int, events: StoreEvents = NULL_EVENTS,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity_bytes = capacity_bytes
        self._events = events
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._leases: dict[str, _Lease] = {}
        self._expiry_heap: list[tuple[float, str]] = []  # (expires_at, lease_id), lazily pruned
        self._used_bytes = 0
        self._num_pinned = 0
        self._num_hits = self._num_misses = self._num_evictions = 0

    # ---- blocks ----------------------------------------------------------------------
    def put(self, blocks: list[StoredBlock], lease_id: str = "") -> int | None:
        blocks = last_wins(blocks)
        with self._lock:
            self._expire_due()
            lease = self._leases.get(lease_id) if lease_id else None
            if lease_id and lease is None:
                raise LeaseNotFound(lease_id)
            victims = self._plan_evictions(blocks)
            if victims is None:
                self._events.put_rejected()
                return None
            for key in victims:
                self._drop(key)
            self._num_evictions += len(victims)
            self._events.evictions(len(victims))
            for block in blocks:
                self._store(block, lease)
            return len(blocks)

    def get(self, keys: list[bytes]) -> list[StoredBlock | None]:
        with self._lock:
            found = [self._touch(key) for key in keys]
            num_hits = sum(b is not None for b in found)
            self._num_hits += num_hits
            self._num_misses += len(keys) - num_hits
        self._events.hits(num_hits)
        self._events.misses(len(keys) - num_hits)
        return found

    def lookup(self, keys: list[bytes]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if self._touch(key) is None:
                    return i
            return len(keys)

    # ---- leases ----------------------------------------------------------------------
    def create_lease(self, ttl_ms: int) -> str:
        lease_id = uuid.uuid4().hex
        with self._lock:
            self._expire_due()
            expires_at = self._clock() + ttl_ms / 1000
            self._leases[lease_id] = _Lease(expires_at)
            heapq.heappush(self._expiry_heap, (expires_at, lease_id))
        self._events.lease_created()
        return lease_id

    def release_lease(self, lease_id: str, drop_tail: bool) -> bool:
        with self._lock:
            self._expire_due()
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._end(lease, drop_tail)
        self._events.lease_released()
        return True

    def expire_leases(self) -> int:
        with self._lock:
            return self._expire_due()

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire_due()
            return StoreStats(self.capacity_bytes, self._used_bytes, len(self._entries), self._num_pinned,
                              len(self._leases), self._num_hits, self._num_misses, self._num_evictions)

    # ---- helpers (lock held) ---------------------------------------------------------
    def _plan_evictions(self, blocks: list[StoredBlock]) -> list[bytes] | None:
        """The least recent unpinned keys to drop so that `blocks` fit; None if impossible."""
        need = self._used_bytes + sum(self._growth(b) for b in blocks) - self.capacity_bytes
        if need <= 0:
            return []
        own = {b.key for b in blocks}
        victims, freed = [], 0
        for key, entry in self._entries.items():
            if entry.num_pins or key in own:
                continue
            victims.append(key)
            freed += entry.block.num_bytes
            if freed >= need:
                return victims
        return None

    def _growth(self, block: StoredBlock) -> int:
        entry = self._entries.get(block.key)
        if entry is None:
            return block.num_bytes
        return block.num_bytes - entry.block.num_bytes if is_tail(block.key) else 0

    def _store(self, block: StoredBlock, lease: _Lease | None) -> None:
        self._used_bytes += self._growth(block)
        entry = self._entries.get(block.key)
        if entry is None:
            entry = self._entries[block.key] = _Entry(block)
        elif is_tail(block.key):
            entry.block = block
        self._entries.move_to_end(block.key)
        if lease is None:
            return
        if block.key not in lease.pinned_keys:
            lease.pinned_keys.add(block.key)
            entry.num_pins += 1
            self._num_pinned += entry.num_pins == 1
        if is_tail(block.key):
            lease.tail_keys.add(block.key)

    def _touch(self, key: bytes) -> StoredBlock | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.block

    def _drop(self, key: bytes) -> None:
        self._used_bytes -= self._entries.pop(key).block.num_bytes

    def _end(self, lease: _Lease, drop_tail: bool) -> None:
        for key in lease.pinned_keys:
            entry = self._entries[key]  # a pinned block is never dropped, so it is there
            entry.num_pins -= 1
            self._num_pinned -= entry.num_pins == 0
        if not drop_tail:
            return
        for key in lease.tail_keys:
            entry = self._entries.get(key)
            if entry is not None and entry.num_pins == 0:
                self._drop(key)

    def _expire_due(self) -> int:
        now, num_expired = self._clock(), 0
        while self._expiry_heap and self._expiry_heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry_heap)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:  # None: released before it expired
                self._end(lease, drop_tail=False)
                num_expired += 1
        if num_expired:
            self._events.leases_expired(num_expired)
        return num_expired
