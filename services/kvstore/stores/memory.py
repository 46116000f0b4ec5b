"""The in-process BlockStore: one OrderedDict in recency order, one lock.

    least recent ──────────────────────────────▶ most recent
    [h1 pinned] [h2] [t:a] [h3 pinned] [h4] ...
    eviction scans from the left, skipping pinned blocks and the put's own keys.

Pinned blocks stay in the recency order (a get still refreshes them), so a block that
loses its last pin is evicted in the place its last use earned it. Skipping pins costs a
scan over them; pins are held only by requests in flight between prefill and decode.

With a disk tier (stores/disk_tier.py) every full block put is also written to disk in the
background, and a memory miss is read from disk (outside the lock) and promoted:

    put ──▶ memory ─ write_behind ─▶ disk      get/lookup ──▶ memory? ── no ──▶ disk? ──▶ promote
    evicted from memory, still on disk: held (no event); dropped from both: REMOVED

The store holds what memory or the disk holds: KV events and put's "new" keys say so.
"""
from __future__ import annotations

import heapq
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.services.kvstore.stores.disk_tier import NO_DISK, BackingTier
from pdserve.services.kvstore.errors import LeaseNotFound
from pdserve.services.kvstore.stores.base import (NO_LEASE, NULL_EVENTS, WRITE_DONE, WRITE_FAILED, WRITE_PENDING, BlockStore,
                                                  StoredBlock, StoreEvents, StoreStats, is_tail, last_wins)

# How often a wait_write re-checks lease expiry: expiry runs on the store's clock, which
# only moves when someone calls in, so a waiter looks at it itself now and then.
_WAIT_SLICE_S = 0.05


# A view may keep this much more than itself alive (a message's header) before it is copied.
_MAX_VIEW_OVERHEAD = 64 << 10


def _owned(data: bytes | memoryview) -> bytes | memoryview:
    """`data` to keep: a view into a received message as it is when the message holds
    little else (one block per message), else a copy. A view into a message of many blocks
    would keep all of them alive as long as one is stored, beyond what capacity counts."""
    if isinstance(data, memoryview) and data.obj is not None and \
            memoryview(data.obj).nbytes - data.nbytes > _MAX_VIEW_OVERHEAD:
        return bytes(data)
    return data


@dataclass
class _Entry:
    block: StoredBlock
    num_pins: int = 0


@dataclass
class _Lease:
    expires_at: float
    pinned_keys: set[bytes] = field(default_factory=set)
    tail_keys: set[bytes] = field(default_factory=set)
    write: str = WRITE_DONE


class MemoryBlockStore(BlockStore):
    def __init__(self, capacity_bytes: int, events: StoreEvents = NULL_EVENTS,
                 clock: Callable[[], float] = time.monotonic, disk: BackingTier | None = None):
        """`disk`: a DiskTier under memory (this store starts and closes it); None: memory only."""
        self.capacity_bytes = capacity_bytes
        self._events = events
        self._clock = clock
        self._lock = threading.Lock()
        self._write_ended = threading.Condition(self._lock)  # a write ended or a lease went
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._leases: dict[str, _Lease] = {}
        self._expiry_heap: list[tuple[float, str]] = []  # (expires_at, lease_id), lazily pruned
        self._used_bytes = 0
        self._num_pinned = 0
        self._num_hits = self._num_misses = self._num_evictions = 0
        self._disk = disk or NO_DISK
        self._disk.start(self._dropped_from_disk)
        if survivors := self._disk.keys():  # blocks a restart found on disk are held again
            self._events.blocks_changed([], survivors)

    # ---- blocks ----------------------------------------------------------------------
    def put(self, blocks: list[StoredBlock], lease_id: str = "") -> int | None:
        blocks = [StoredBlock(b.key, b.header, _owned(b.data), b.size) for b in last_wins(blocks)]
        with self._lock:
            self._expire_due()
            lease = self._lease(lease_id)
            victims = self._plan_evictions(blocks)
            if victims is None:
                self._events.put_rejected()
                return None
            self._evict(victims)
            new_keys = [b.key for b in blocks if b.key not in self._entries and not self._disk.holds(b.key)]
            for block in blocks:
                self._store(block, lease)
                self._disk.write_behind(block)
            self._events.blocks_changed(self._gone(victims), new_keys)
            return len(blocks)

    def get(self, keys: list[bytes]) -> list[StoredBlock | None]:
        with self._lock:
            found = [self._touch(key) for key in keys]
            on_disk = [i for i, b in enumerate(found) if b is None and self._disk.holds(keys[i])]
            if not on_disk:
                num_hits = self._count(found)
        if on_disk:  # read outside the lock: a disk's time holds up no other call
            loaded = self._disk.read([keys[i] for i in on_disk])
            with self._lock:
                for i, block in zip(on_disk, loaded):
                    if block is not None:
                        self._promote(block)  # served even when memory has no room for it
                        found[i] = block
                num_hits = self._count(found)
        self._events.hits(num_hits)
        self._events.misses(len(keys) - num_hits)
        return found

    def lookup(self, keys: list[bytes], lease_id: str = "") -> int:
        with self._lock:
            self._expire_due()
            num_found = self._pin_prefix(keys, self._lease(lease_id), {})
            if num_found == len(keys) or not self._disk.holds(keys[num_found]):
                return num_found
        # the prefix goes on on disk: read it outside the lock, then promote and pin it
        loaded = {block.key: block for block in self._disk.read_prefix(keys[num_found:])}
        with self._lock:
            self._expire_due()
            return self._pin_prefix(keys, self._lease(lease_id), loaded)

    # ---- leases ----------------------------------------------------------------------
    def create_lease(self, ttl_ms: int, write_pending: bool = False) -> str:
        lease_id = uuid.uuid4().hex
        with self._lock:
            self._expire_due()
            expires_at = self._clock() + ttl_ms / 1000
            self._leases[lease_id] = _Lease(expires_at, write=WRITE_PENDING if write_pending else WRITE_DONE)
            heapq.heappush(self._expiry_heap, (expires_at, lease_id))
        self._events.lease_created()
        return lease_id

    def end_write(self, lease_id: str, failed: bool) -> bool:
        with self._lock:
            self._expire_due()
            lease = self._leases.get(lease_id)
            if lease is None or lease.write != WRITE_PENDING:
                return False
            lease.write = WRITE_FAILED if failed else WRITE_DONE
            self._write_ended.notify_all()
            return True

    def wait_write(self, lease_id: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._expire_due()
                lease = self._leases.get(lease_id)
                state = NO_LEASE if lease is None else lease.write
                remaining = deadline - time.monotonic()
                if state != WRITE_PENDING or remaining <= 0:
                    return state
                self._write_ended.wait(min(remaining, _WAIT_SLICE_S))

    def release_lease(self, lease_id: str, drop_tail: bool) -> bool:
        with self._lock:
            self._expire_due()
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._end(lease, drop_tail)
            self._write_ended.notify_all()
        self._events.lease_released()
        return True

    def expire_leases(self) -> int:
        with self._lock:
            return self._expire_due()

    def stats(self) -> StoreStats:
        with self._lock:
            self._expire_due()
            return StoreStats(self.capacity_bytes, self._used_bytes, len(self._entries), self._num_pinned,
                              len(self._leases), self._num_hits, self._num_misses, self._num_evictions,
                              self._disk.stats())

    def close(self) -> None:
        self._disk.close()  # writes what is still queued for the disk first

    def _dropped_from_disk(self, keys: list[bytes]) -> None:
        """Keys that left the disk (evicted, not written, damaged): gone from the store
        unless memory has them. Called off the lock, by the disk's writer or a reader."""
        with self._lock:
            if gone := [k for k in keys if k not in self._entries and not self._disk.holds(k)]:
                self._events.blocks_changed(gone, [])

    # ---- helpers (lock held) ---------------------------------------------------------
    def _lease(self, lease_id: str) -> _Lease | None:
        """The lease named, None for ""; an unknown one raises."""
        if not lease_id:
            return None
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(lease_id)
        return lease

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

    def _evict(self, victims: list[bytes]) -> None:
        for key in victims:
            self._drop(key)
        self._num_evictions += len(victims)
        self._events.evictions(len(victims))

    def _gone(self, victims: list[bytes]) -> list[bytes]:
        """The keys evicted from memory that the store no longer holds: not on disk either."""
        return [k for k in victims if not self._disk.holds(k)]

    def _promote(self, block: StoredBlock) -> bool:
        """Stores a block read from disk in memory, evicting as a put would; False when
        memory has no room (everything pinned). It is new to the store only when the disk
        dropped it since it was read."""
        victims = self._plan_evictions([block])
        if victims is None:
            return False
        self._evict(victims)
        new_keys = [] if block.key in self._entries or self._disk.holds(block.key) else [block.key]
        self._store(block, None)
        if (gone := self._gone(victims)) or new_keys:
            self._events.blocks_changed(gone, new_keys)
        return True

    def _pin_prefix(self, keys: list[bytes], lease: _Lease | None, loaded: dict[bytes, StoredBlock]) -> int:
        """How many leading keys memory holds, the `loaded` ones promoted into it on the
        way; those become most recent and, under a lease, are pinned by it."""
        for i, key in enumerate(keys):
            if self._touch(key) is None and not (key in loaded and self._promote(loaded[key])):
                return i
            if lease is not None:
                self._pin(key, lease)
        return len(keys)

    def _count(self, found: list[StoredBlock | None]) -> int:
        num_hits = sum(b is not None for b in found)
        self._num_hits += num_hits
        self._num_misses += len(found) - num_hits
        return num_hits

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
        self._pin(block.key, lease)
        if is_tail(block.key):
            lease.tail_keys.add(block.key)

    def _pin(self, key: bytes, lease: _Lease) -> None:
        """Pins a stored key by the lease, once per lease."""
        if key not in lease.pinned_keys:
            lease.pinned_keys.add(key)
            entry = self._entries[key]
            entry.num_pins += 1
            self._num_pinned += entry.num_pins == 1

    def _touch(self, key: bytes) -> StoredBlock | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self._disk.touch(key)  # a use of the block: the disk's order follows memory's
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
            self._write_ended.notify_all()
            self._events.leases_expired(num_expired)
        return num_expired
