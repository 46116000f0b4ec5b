"""The memory a Mooncake client's transfers land in and leave from, kept between calls:
ReadBuffers (heap memory, each block registered with the client's transfer engine once)
and ShmBuffers (shared memory a store node on this host maps, for its dummy client:
services/kvstore/transports/mooncake/local.py)."""
from __future__ import annotations

import collections
import ctypes
import logging
import threading
import weakref
from collections.abc import Callable

import grpc
import numpy as np

from pdserve.services.kvstore.errors import KVStoreError

logger = logging.getLogger(__name__)


def plane_call(what: str, method, *args):
    """A Mooncake call whose failure the workers handle as any kvstore failure (a
    grpc.RpcError: the reader recomputes, the writer ends its write failed)."""
    try:
        return method(*args)
    except Exception as e:  # pybind raises RuntimeError and others: all are the plane's
        raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"Mooncake Store {what} failed: {e}") from None


class ReadBuffers:
    """Memory the gets land in, kept from one get to the next: each block of it registered
    with the transfer engine once and its pages mapped by its first use. A get takes the
    smallest free block that fits and hands out a view of it; the block is free again when
    nothing views it any more (the decode has copied the KV into its cache and dropped the
    payload), which a weakref to the view tells. Blocks are sized in powers of two (so later,
    smaller reads fit) and hold at most `max_bytes` together: past that, free blocks are let
    go, and a read that still finds no room gets a buffer of its own, registered for that call
    only (what every read did before)."""

    MIN_BYTES = 1 << 20

    def __init__(self, plane, max_bytes: int):
        """`plane`: a callable returning the Mooncake client (so a test may swap it)."""
        self._plane, self._max_bytes = plane, max_bytes
        self._lock = threading.Lock()
        self._blocks: dict[int, np.ndarray] = {}  # address -> the block, registered
        self._free: set[int] = set()
        # Views that died, appended by their finalizers: these may run in any thread, even
        # one inside take() (a garbage collection), so they only append, never lock.
        self._released: collections.deque[int] = collections.deque()
        self._closed = False

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._blocks.values())

    def take(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """A buffer of `nbytes` and whether it is registered already (a kept block's view)."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8), False
        with self._lock:
            self._collect()
            fits = [a for a in self._free if self._blocks[a].nbytes >= nbytes]
            if fits:
                address = min(fits, key=lambda a: self._blocks[a].nbytes)
            else:
                address = self._new_block(max(self.MIN_BYTES, 1 << (nbytes - 1).bit_length()))
                if address is None:
                    return np.empty(nbytes, dtype=np.uint8), False
            self._free.discard(address)
            view = self._blocks[address][:nbytes]
        weakref.finalize(view, self._released.append, address)
        return view, True

    def covers(self, address: int, size: int) -> bool:
        """Whether [address, address + size) lies in one kept block (registered)."""
        return self.block_of(address, size) is not None

    def block_of(self, address: int, size: int) -> tuple[int, int] | None:
        """(address, size) of the kept block [address, address + size) lies in, if any."""
        with self._lock:
            return next(((a, b.nbytes) for a, b in self._blocks.items() if a <= address and address + size <= a + b.nbytes),
                        None)

    def _collect(self) -> None:  # lock held
        while self._released:
            address = self._released.popleft()
            if address in self._blocks:
                self._free.add(address)

    def _new_block(self, size: int) -> int | None:  # lock held
        held = self._held()
        for address in sorted(self._free, key=lambda a: self._blocks[a].nbytes):
            if held + size <= self._max_bytes or not self.lets_go:
                break
            held -= self._blocks[address].nbytes
            self._drop(address)
        if held + size > self._max_bytes or self._closed:
            return None
        block = self._allocate(size)
        if block is None:
            return None
        self._blocks[block.ctypes.data] = block
        return block.ctypes.data

    # what a kind of buffer changes: how a block is made, whether one may be let go
    lets_go = True

    def _held(self) -> int:  # lock held
        return sum(b.nbytes for b in self._blocks.values())

    def _allocate(self, size: int) -> np.ndarray | None:  # lock held
        block = np.empty(size, dtype=np.uint8)
        code = plane_call("register", self._plane().register_buffer, block.ctypes.data, size)
        if code != 0:
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"Mooncake could not register {size} bytes: code {code}")
        return block

    def _drop(self, address: int) -> None:  # lock held; the block is free
        self._free.discard(address)
        del self._blocks[address]
        try:
            self._plane().unregister_buffer(address)
        except Exception as e:  # the client closing: nothing to keep registered
            logger.debug("unregistering a read buffer failed: %s", e)

    def close(self) -> None:
        """Unregisters the free blocks and keeps no block: one still viewed lives as long as
        its views do (numpy's base reference), unregistered with the client's close."""
        with self._lock:
            self._collect()
            for address in list(self._free):
                self._drop(address)
            self._blocks.clear()
            self._closed = True


class ShmBuffers(ReadBuffers):
    """ReadBuffers for a worker attached to its host's store node (a dummy client): each
    block is shared memory from the client's alloc_from_mem_pool, registered whole with
    the node (which maps it), so a read lands in it and an export is put from it without
    a copy in this process. Mooncake's Python API frees no such memory: a block is kept
    for the client's life and the bound is never exceeded (a read that finds no room
    gets memory of its own and goes over TCP). A block made while the node was away
    (its registration failed) is used once the node is back (register_pending); a node that
    restarted gets a fresh client, whose memory replaces this one's (switch)."""

    lets_go = False

    def __init__(self, client, max_bytes: int):
        super().__init__(lambda: self._client, max_bytes)
        self._client = client
        self._pending: dict[int, np.ndarray] = {}  # made, not registered with the node (it was away)
        # (client, addresses of its blocks still viewed, its blocks) of clients switched from:
        # their memory stays mapped while a view of it lives, then the client is closed
        self._retired: list[tuple[object, set[int], list[np.ndarray]]] = []
        # told the addresses of a retired client's blocks before it closes (their memory is
        # unmapped then): whoever registered them elsewhere lets them go, or memory mapped
        # there later would overlap a stale registration (the transport's TCP client)
        self.on_close: Callable[[list[int]], None] = lambda addresses: None

    def _held(self) -> int:  # lock held
        return super()._held() + sum(b.nbytes for b in self._pending.values())

    def _allocate(self, size: int) -> np.ndarray | None:  # lock held
        try:
            address = self._plane().alloc_from_mem_pool(size)
        except Exception as e:  # pybind: any failure of the client's
            logger.warning("Mooncake could not allocate %d bytes of shared memory: %s", size, e)
            return None
        if not address:
            logger.warning("Mooncake could not allocate %d bytes of shared memory", size)
            return None
        block = np.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=np.uint8)
        if self._register_with_node(address, size):
            return block
        self._pending[address] = block
        return None

    def _register_with_node(self, address: int, size: int) -> bool:
        try:
            return self._plane().register_buffer(address, size) == 0
        except Exception as e:
            logger.debug("registering shared memory with the store node failed: %s", e)
            return False

    def register_pending(self) -> None:
        """Registers the blocks made while the node was away, which join the free ones."""
        with self._lock:
            for address, block in list(self._pending.items()):
                if self._register_with_node(address, block.nbytes):
                    del self._pending[address]
                    self._blocks[address] = block
                    self._free.add(address)

    def switch(self, client) -> None:
        """The node is back, `client` a fresh dummy client of it (LocalNode): blocks come
        from its memory from now on. The old client's blocks are never handed out again;
        it is closed once nothing views them (their pages stay mapped until then)."""
        if client is self._client:  # the same client, reconnected by itself
            self.register_pending()
            return
        with self._lock:
            self._collect()
            in_use = set(self._blocks) - self._free
            self._retired.append((self._client, in_use, [*self._blocks.values(), *self._pending.values()]))
            self._blocks.clear()
            self._free.clear()
            self._pending.clear()
            self._client = client
            self._close_retired()

    def _collect(self) -> None:  # lock held
        while self._released:
            address = self._released.popleft()
            if address in self._blocks:
                self._free.add(address)
            for _, in_use, _ in self._retired:
                in_use.discard(address)
        self._close_retired()

    def _close_retired(self) -> None:  # lock held
        kept = []
        for client, in_use, blocks in self._retired:
            if in_use:
                kept.append((client, in_use, blocks))
                continue
            self.on_close([b.ctypes.data for b in blocks])
            try:
                client.close()
            except Exception as e:  # its node is gone: nothing of it to keep
                logger.debug("closing a retired Mooncake dummy client failed: %s", e)
        self._retired = kept

    def _drop(self, address: int) -> None:  # never let go: see the class docstring
        raise AssertionError("a shared memory block is kept for the client's life")

    def close(self) -> None:
        """Keeps every block mapped (views of them may outlive the client, and Mooncake
        frees none); the node unmaps its side when the client closes."""
        with self._lock:
            self._blocks.clear()
            self._free.clear()
            self._pending.clear()
            self._closed = True
