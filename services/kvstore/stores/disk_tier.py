"""A disk tier under the memory backend, so a kvstore restarted on a folder that survived
(a pod's emptyDir after a container crash, a volume) finds its full blocks again.

    MemoryBlockStore.put ──▶ memory ── write_behind ──▶ queue ──▶ writer thread ──▶ BlockFiles
    get / lookup miss ─────▶ read: a queued block first, then its file ◀──────────────────┘
                             (checksum checked; promoted into memory by the store)

Only full blocks (keys b"h:...") go to disk: tails are request-scoped, and leases live in
memory only. The files and their format: services/kvstore/stores/disk_files.py.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

from pdserve.services.kvstore.stores.disk_files import BlockFiles
from pdserve.services.kvstore.stores.base import HASH_PREFIX, DiskStats, StoredBlock

logger = logging.getLogger(__name__)


class BackingTier:
    """What MemoryBlockStore keeps below memory. This base keeps nothing (memory only, the
    default), so the store needs no flag. `read` is never called under the store's lock:
    it may take a disk's time, and it reports lost keys through on_dropped."""

    def start(self, on_dropped: Callable[[list[bytes]], None]) -> None:
        """on_dropped(keys): keys that left this tier (evicted, a failed write, a damaged
        file), called from the tier's own threads or a reader's, never under its lock."""

    def holds(self, key: bytes) -> bool:
        return False

    def touch(self, key: bytes) -> None: ...
    def write_behind(self, block: StoredBlock) -> None: ...

    def read(self, keys: list[bytes]) -> list[StoredBlock | None]:
        """The blocks, None for one not held (or found damaged: then dropped)."""
        return [None] * len(keys)

    def read_prefix(self, keys: list[bytes]) -> list[StoredBlock]:
        """The leading blocks held, up to the first that is not."""
        return []

    def keys(self) -> list[bytes]:
        return []

    def stats(self) -> DiskStats | None:
        return None

    def close(self) -> None: ...


NO_DISK = BackingTier()


class DiskTier(BackingTier):
    """BlockFiles behind a write-behind queue. A put's full blocks are queued and written
    by one thread, so a put never waits on the disk; a block that would take the queue
    past `max_queued_bytes` is skipped (counted) and stays off the disk until a later put
    of it. A queued block counts as held and is read from the queue, so a block evicted
    from memory before its write is still found."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, max_queued_bytes: int = 256 << 20,
                 fsync: bool = False):
        self.files = BlockFiles(directory, capacity_bytes, fsync)
        self.max_queued_bytes = max_queued_bytes
        self._queue: queue.SimpleQueue[StoredBlock | _Marker | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[bytes, StoredBlock] = {}  # queued or being written
        self._queued_bytes = 0
        self._num_hits = self._num_writes = self._num_skipped = self._num_failed = 0
        self._on_dropped: Callable[[list[bytes]], None] = lambda keys: None
        self._writer: threading.Thread | None = None

    def start(self, on_dropped: Callable[[list[bytes]], None]) -> None:
        self._on_dropped = on_dropped
        self._writer = threading.Thread(target=self._run, name="kvstore-disk-writer", daemon=True)
        self._writer.start()

    def holds(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending or self.files.contains(key)

    def touch(self, key: bytes) -> None:
        self.files.touch(key)

    def write_behind(self, block: StoredBlock) -> None:
        """Queues a full block for writing, unless held already (then it is only touched)."""
        num_bytes = len(block.data)
        if not block.key.startswith(HASH_PREFIX) or num_bytes != block.num_bytes:
            return  # a tail (request-scoped), or bytes kept elsewhere (a data plane)
        with self._lock:
            if block.key in self._pending:
                return
            if self.files.contains(block.key):
                self.files.touch(block.key)
                return
            if self._queued_bytes + num_bytes > self.max_queued_bytes:
                self._num_skipped += 1
                return
            self._pending[block.key] = block
            self._queued_bytes += num_bytes
        self._queue.put(block)

    def read(self, keys: list[bytes]) -> list[StoredBlock | None]:
        return [self._read(key) for key in keys]

    def read_prefix(self, keys: list[bytes]) -> list[StoredBlock]:
        found = []
        for key in keys:
            if (block := self._read(key)) is None:
                break
            found.append(block)
        return found

    def _read(self, key: bytes) -> StoredBlock | None:
        with self._lock:
            block = self._pending.get(key)
            on_disk = block is None and self.files.contains(key)
        if on_disk and (block := self.files.get(key)) is None:
            self._on_dropped([key])  # damaged, or removed since: the store may have lost it
        if block is not None:
            with self._lock:
                self._num_hits += 1
        return block

    def keys(self) -> list[bytes]:
        with self._lock:
            return [*self.files.keys(), *(k for k in self._pending if not self.files.contains(k))]

    def stats(self) -> DiskStats:
        with self._lock:
            f = self.files
            return DiskStats(f.capacity_bytes, f.used_bytes, f.num_blocks, self._num_hits, self._num_writes,
                             self._num_skipped, self._num_failed, f.num_corrupt)

    def flush(self) -> None:
        """Waits until every block queued so far is written (tests; close does it too)."""
        done = threading.Event()
        self._queue.put(_Marker(done))
        done.wait()

    def close(self) -> None:
        """Writes what is queued, then stops the writer and lets go of the folder."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        self.files.close()

    # ---- the writer thread -----------------------------------------------------------
    def _run(self) -> None:
        while (block := self._queue.get()) is not None:
            if isinstance(block, _Marker):
                block.done.set()
                continue
            lost = self._write(block)
            if lost:
                self._on_dropped(lost)

    def _write(self, block: StoredBlock) -> list[bytes]:
        """Writes one queued block; the keys that left the disk for it (or it, not written)."""
        try:
            evicted = self.files.put(block)
            error = None if evicted is not None else f"{len(block.data)} bytes exceed the whole capacity"
        except OSError as e:
            evicted, error = None, e
        if error is not None and self._num_failed & (self._num_failed + 1) == 0:  # the 1st, 2nd, 4th...
            logger.warning("kvstore disk tier: cannot write a block (%d failed so far): %s", self._num_failed + 1,
                           error)
        with self._lock:
            del self._pending[block.key]
            self._queued_bytes -= len(block.data)
            self._num_failed += evicted is None
            self._num_writes += evicted is not None
        return [block.key] if evicted is None else evicted


class _Marker:
    """A place in the writer's queue: set once everything before it is written."""

    def __init__(self, done: threading.Event):
        self.done = done
