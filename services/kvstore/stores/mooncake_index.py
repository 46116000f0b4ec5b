"""The kvstore's BlockStore when the bytes live in Mooncake Store: the memory store's
index, leases and LRU over entries that hold a header and the size of bytes kept in the
data plane (services/kvstore/transports/mooncake/plane.py).

The index is the authority on what the kvstore offers: a block it evicts (or a tail a
lease drops) is removed from Mooncake too, off the store's lock, so the plane holds what
the index names. Mooncake may still lose an object the index names (its own eviction
under fragmentation, a store node killed with one replica, a master restarted with none
of its old objects): a reader then finds it missing and recomputes, as it does for any
block not found, and a reconciler asks the plane every few seconds which indexed
objects still exist and drops the others, so the next prefill writes them again
instead of being told they are there.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
import time

from pdserve.services.kvstore.stores.memory import MemoryBlockStore
from pdserve.services.kvstore.transports.mooncake.plane import MooncakeSettings, object_key
from pdserve.services.kvstore.stores.base import NULL_EVENTS, StoreEvents
from pdserve.services.pb import kvstore_pb2

logger = logging.getLogger(__name__)

# Removals waiting for the remover thread; beyond this many, a removal is skipped (the
# object then waits for Mooncake's own eviction) rather than blocking a put.
_MAX_PENDING_REMOVALS = 65_536
_REMOVE_BATCH = 256
RECONCILE_INTERVAL_S = 2.0
_EXIST_BATCH = 4096  # keys per batch_is_exist call


class MooncakeIndexStore(MemoryBlockStore):
    def __init__(self, capacity_bytes: int, settings: MooncakeSettings, plane, events: StoreEvents = NULL_EVENTS,
                 clock: Callable[[], float] = time.monotonic, reconcile_interval_s: float = RECONCILE_INTERVAL_S):
        """`plane`: a connected Mooncake client (mooncake_plane.connect) this store removes
        objects with and asks what exists; it contributes no memory of its own."""
        super().__init__(capacity_bytes, events, clock)
        self.settings = settings
        self._plane = plane
        self._removals: queue.Queue[str | None] = queue.Queue(_MAX_PENDING_REMOVALS)
        self.num_removals_skipped = 0
        self.num_lost = 0  # indexed blocks the plane no longer had, dropped by the reconciler
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._remove_loop, name="kvstore-mooncake-remover", daemon=True),
                         threading.Thread(target=self._reconcile_loop, args=(reconcile_interval_s,),
                                          name="kvstore-mooncake-reconciler", daemon=True)]
        for thread in self._threads:
            thread.start()

    def reconcile(self) -> int:
        """Drops the unpinned index entries whose objects the plane no longer has; how many.
        A pinned one stays until its lease ends (its reader is told it is missing)."""
        with self._lock:
            named = [(key, object_key(key, kvstore_pb2.KVBlockHeader.FromString(entry.block.header).checksum))
                     for key, entry in self._entries.items()]
        missing = []
        for start in range(0, len(named), _EXIST_BATCH):
            chunk = named[start:start + _EXIST_BATCH]
            exists = self._plane.batch_is_exist([name for _, name in chunk])
            missing += [key for (key, _), found in zip(chunk, exists) if found == 0]  # < 0: could not tell
        with self._lock:
            lost = [k for k in missing if k in self._entries and self._entries[k].num_pins == 0]
            for key in lost:
                MemoryBlockStore._drop(self, key)  # nothing to remove from the plane
            if lost:
                self._events.blocks_changed(lost, [])
        if lost:
            self.num_lost += len(lost)
            self._events.blocks_lost(len(lost))
            logger.warning("%d indexed blocks are gone from Mooncake Store (a store node or the master restarted); "
                           "dropped from the index, to be written again", len(lost))
        return len(lost)

    def _reconcile_loop(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            try:
                self.reconcile()
            except Exception as e:  # the master away: the next pass tries again
                logger.debug("reconciling the index with Mooncake failed: %s", e)

    def _drop(self, key: bytes) -> None:  # lock held: an eviction, or a tail its lease drops
        header = kvstore_pb2.KVBlockHeader.FromString(self._entries[key].block.header)
        super()._drop(key)
        try:
            self._removals.put_nowait(object_key(key, header.checksum))
        except queue.Full:
            self.num_removals_skipped += 1

    def _remove_loop(self) -> None:
        while True:
            keys = [self._removals.get()]
            while len(keys) < _REMOVE_BATCH and not self._removals.empty():
                keys.append(self._removals.get_nowait())
            if None in keys:
                return
            try:
                # An object read in the last seconds is leased by Mooncake and refuses removal
                # (-706): it is left to Mooncake's eviction, like any object it outlives.
                self._plane.batch_remove(keys)
            except Exception as e:  # the master away: the objects stay until it evicts them
                logger.warning("removing %d blocks from Mooncake failed: %s", len(keys), e)

    def close(self) -> None:
        self._closed.set()
        self._removals.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        super().close()
        try:
            self._plane.close()
        except Exception as e:
            logger.warning("closing the Mooncake client failed: %s", e)
