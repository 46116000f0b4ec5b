"""The storage contract of the kvstore: blocks by key, LRU eviction, leases that pin.

Keys are bytes: b"h:" + block hash for a full block (content-addressed, shared by every
request with that prefix), b"t:" + tail key for a request's partial last block. A block
is stored as its serialized KVBlockHeader plus its raw bytes; the store never looks
inside either (validation happens before, in validate.py).

    prefill P                         kvstore                        decode D
    create_lease(ttl, pending) ──────▶ lease L (expires at now+ttl), write pending
    lookup([h0, h1, h2], L) ─────────▶ h0 found: pinned by L
    handle{h0, h1, h2, t:req, L} ───────────────────────────────────▶ wait_write(L) ...
    put([h1, h2, t:req], L) ─────────▶ h1 h2 t:req stored, pinned by L
    end_write(L) ────────────────────▶ write done ─────────────────▶ ... get([h0..h2], [t:req])
                                       L released (drop_tail): h0..h2 ◀── release_lease(L)
                                       unpinned, t:req deleted
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

HASH_PREFIX = b"h:"
TAIL_PREFIX = b"t:"


def hash_key(block_hash: bytes) -> bytes:
    return HASH_PREFIX + block_hash


def tail_key(key: str) -> bytes:
    return TAIL_PREFIX + key.encode()


def is_tail(key: bytes) -> bool:
    return key.startswith(TAIL_PREFIX)


# A lease's write, as wait_write reports it.
WRITE_DONE = "done"        # ended well, or the lease was created with nothing pending
WRITE_FAILED = "failed"    # the writer gave up: some blocks may be missing
WRITE_PENDING = "pending"  # still being written (wait_write timed out)
NO_LEASE = ""              # unknown, released or expired: nothing to wait for


@dataclass(frozen=True)
class StoredBlock:
    key: bytes
    header: bytes  # a serialized KVBlockHeader
    data: bytes | memoryview  # a view into a received message until the backend stores it
    # The block's bytes when they are kept elsewhere (the Mooncake data plane) and `data`
    # is empty: an index entry still counts what it stands for. None: len(data).
    size: int | None = None

    @property
    def num_bytes(self) -> int:
        # Capacity counts KV bytes only: headers are tens of bytes beside kilobytes of data.
        return len(self.data) if self.size is None else self.size


@dataclass(frozen=True)
class StoreStats:
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    num_pinned_blocks: int
    num_active_leases: int
    num_hits: int
    num_misses: int
    num_evictions: int
    disk: DiskStats | None = None  # the memory backend's disk tier, when it has one


@dataclass(frozen=True)
class DiskStats:
    """A disk tier's (services/kvstore/stores/disk_tier.py): gauges, then counters since start."""
    capacity_bytes: int
    used_bytes: int          # block data bytes in its files, counted as capacity counts them
    num_blocks: int
    num_hits: int            # blocks read back from it (a memory miss it served)
    num_writes: int          # blocks written to it
    num_skipped_writes: int  # blocks not written: its writer's queue was full
    num_failed_writes: int   # blocks not written: the disk refused (full, read-only, ...)
    num_corrupt: int         # files found damaged (size or checksum) and deleted


class StoreEvents:
    """Where a store reports what happened, for metrics. This base ignores everything,
    so a store used without metrics (tests, tools) needs no flag."""

    def hits(self, n: int) -> None: ...
    def misses(self, n: int) -> None: ...
    def evictions(self, n: int) -> None: ...
    def put_rejected(self) -> None: ...
    def lease_created(self) -> None: ...
    def lease_released(self) -> None: ...
    def leases_expired(self, n: int) -> None: ...
    # indexed blocks whose bytes the data plane no longer had (Mooncake's master restarted,
    # a store node lost its only replica), dropped from the index
    def blocks_lost(self, n: int) -> None: ...
    # keys that left (evicted) and then keys new to the store, by one put; for KV events
    # (services/kvstore/block_events.py). Called under the store's lock, so in store order.
    def blocks_changed(self, evicted: list[bytes], stored: list[bytes]) -> None: ...


NULL_EVENTS = StoreEvents()


class BlockStore(abc.ABC):
    """Blocks by key within `capacity_bytes`, with least-recently-used eviction.

    - put(blocks, lease_id): all or nothing. A key already stored is not stored twice:
      a full block keeps its bytes (its hash fixes its content), a tail is overwritten.
      Every block put is made most recent, in the order given. When the new bytes do not
      fit, unpinned blocks not in this put are evicted, least recent first; when even
      evicting all of them would not make room, nothing is evicted, nothing stored, and
      put returns None. Under a lease, each block is pinned by it (once per lease).
      An unknown, released or expired lease raises LeaseNotFound.
    - get(keys): the blocks, None for a missing one; each hit becomes most recent.
    - lookup(keys, lease_id): how many leading keys are stored; those become most recent
      (the caller is about to rely on them) and, under a lease, are pinned by it (a prefill
      that does not write them again still keeps them for its decode). An unknown lease
      raises LeaseNotFound.
    - create_lease(ttl_ms, write_pending) -> lease id. With write_pending the lease's
      write is pending until end_write(id, failed) (or the lease ends); wait_write(id,
      timeout_s) waits up to timeout_s for that and returns the WRITE_* state it saw.
    - release_lease(id, drop_tail) unpins the lease's blocks and, with drop_tail, deletes
      its tail blocks that no other lease pins; True exactly once per lease, False once
      released or expired.
    - expire_leases(): ends every lease past its expiry (unpins; its tails stay, as
      ordinary evictable blocks) and returns how many. Every other method also ends due
      leases first, so expiry never waits for a sweeper to be observed.
    A pinned block is never evicted or dropped. Methods are safe to call from many threads.
    """

    capacity_bytes: int

    @abc.abstractmethod
    def put(self, blocks: list[StoredBlock], lease_id: str = "") -> int | None: ...

    @abc.abstractmethod
    def get(self, keys: list[bytes]) -> list[StoredBlock | None]: ...

    @abc.abstractmethod
    def lookup(self, keys: list[bytes], lease_id: str = "") -> int: ...

    @abc.abstractmethod
    def create_lease(self, ttl_ms: int, write_pending: bool = False) -> str: ...

    @abc.abstractmethod
    def end_write(self, lease_id: str, failed: bool) -> bool:
        """Ends the lease's pending write; False when it had none or the lease is gone."""

    @abc.abstractmethod
    def wait_write(self, lease_id: str, timeout_s: float) -> str: ...

    @abc.abstractmethod
    def release_lease(self, lease_id: str, drop_tail: bool) -> bool: ...

    @abc.abstractmethod
    def expire_leases(self) -> int: ...

    @abc.abstractmethod
    def stats(self) -> StoreStats: ...

    def close(self) -> None:
        """Releases connections; the default holds none."""


def last_wins(blocks: list[StoredBlock]) -> list[StoredBlock]:
    """One block per key, the last one given, in order of first appearance."""
    by_key: dict[bytes, StoredBlock] = {}
    for block in blocks:
        by_key[block.key] = block
    return list(by_key.values())
