"""transport="mooncake": a worker's blocks go straight between its buffers and Mooncake
Store (services/kvstore/mooncake_plane.py); the kvstore sees only their headers.

    put_blocks: register the export buffer, batch_put_from every block under its object
                key (replicated as the plane says), then PutBlocks(headers, bytes_in_data_plane)
                so the kvstore indexes (and pins, under a lease) what is now there
    get_blocks: GetBlocks(headers_only) says which blocks exist (after waiting for a pending
                write, as before), then batch_get_into one registered buffer; a block the
                plane lost is reported not found, so the reader recomputes it

The bytes are copied once, by Mooncake's transfer engine (its own threads), between the
worker's memory and a store node's segment: no Python, no protobuf, no kvstore process.

Reads land in buffers kept from one get to the next (ReadBuffers): registered with the
transfer engine once, their pages already mapped. A fresh buffer per read cost more than
the transfer itself here: the first write to each 4 KiB page faults (about 5 us a page
on this machine, 55 ms for 45 MiB, against about 30 ms to move the bytes).

A transfer is waited for on a thread of low priority (nice TRANSFER_WAIT_NICE): Mooncake's
client waits for its transfers by polling their status without pause (perf: about 60 %
of the client's CPU samples in clock_gettime, a mutex and getTransferStatus), which takes a
core from the threads that move the bytes (its own TCP thread, the store node's) when
cores are few. At nice 19 the poll runs when a core is free, and still within a
scheduler period when none is: on 2 cores, transfers took 20-35 % less time.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from services.kvstore.batch_codec import Decoded, OutBatch
from services.kvstore.errors import KVStoreError
from services.kvstore import mooncake_plane
from services.kvstore.mooncake_plane import (READ_BUFFER_BYTES, TRANSFER_FAIL, MooncakeSettings, object_key,
                                             replicate_config)
from services.kvstore.transport import BlockTransport, GrpcTransport
from services.kvstore.validate import block_nbytes, key_for_hash, key_for_tail
from services.pb import kvstore_pb2

logger = logging.getLogger(__name__)

_FAILOVER_POLL_S = 0.25
_TRANSFER_WAITERS = 32  # transfers of one client waited for at once (threads made as needed)


def _store_key(header: kvstore_pb2.KVBlockHeader) -> bytes:
    if header.block_hash:
        return key_for_hash(header.block_hash, "block_hash")
    return key_for_tail(header.tail_key, "tail_key")


def _address(view: memoryview) -> tuple[np.ndarray, int]:
    array = np.frombuffer(view, dtype=np.uint8)  # no copy; kept by the caller while in use
    return array, array.ctypes.data


class MooncakeTransport(BlockTransport):
    put_batch_bytes = 1 << 62  # one control message per put: it carries headers only

    def __init__(self, control: GrpcTransport, settings: MooncakeSettings, plane,
                 read_buffer_bytes: int = READ_BUFFER_BYTES):
        """`control`: the kvstore's gRPC transport, for the index calls; `plane`: a
        connected Mooncake client (mooncake_plane.connect); `read_buffer_bytes`: how much
        memory the read buffers kept between gets may hold."""
        self._control, self.settings, self._plane = control, settings, plane
        self._replicate = replicate_config(settings)
        self._reads = ReadBuffers(lambda: self._plane, read_buffer_bytes)
        self._waiters = ThreadPoolExecutor(_TRANSFER_WAITERS, "mooncake-transfer", initializer=_lower_priority,
                                           initargs=(mooncake_plane.TRANSFER_WAIT_NICE,))

    # ---- the block paths ------------------------------------------------------------
    def put_blocks(self, batches: list[OutBatch]) -> kvstore_pb2.PutResponse:
        keys, views = [], []
        for batch in batches:
            data = memoryview(b"".join(batch.buffers)) if len(batch.buffers) != 1 else \
                memoryview(batch.buffers[0]).cast("B")
            offset = 0
            for header in batch.message.headers:
                size = block_nbytes(header)
                keys.append(object_key(_store_key(header), header.checksum))
                views.append(data[offset:offset + size])
                offset += size
        self._put_bytes(keys, views)
        index = []
        for batch in batches:
            message = kvstore_pb2.PutBlocksRequest(lease_id=batch.message.lease_id, bytes_in_data_plane=True)
            message.headers.extend(batch.message.headers)
            index.append(OutBatch(message, []))
        return self._control.put_blocks(index)

    def get_blocks(self, request: kvstore_pb2.GetRequest) -> list[Decoded]:
        asked = kvstore_pb2.GetRequest()
        asked.CopyFrom(request)
        asked.headers_only = True
        answers = self._control.get_blocks(asked)
        wanted = [(a, i, h) for a in answers for i, (h, found) in enumerate(zip(a.message.headers, a.message.found))
                  if found]
        sizes = [block_nbytes(h) for _, _, h in wanted]
        buffer, registered = self._reads.take(sum(sizes))
        got = self._get_bytes([object_key(_store_key(h), h.checksum) for _, _, h in wanted], buffer, sizes,
                              registered)
        decoded, offset, place = [], 0, 0
        for answer in answers:
            message = kvstore_pb2.KVBlockBatch()
            start, parts, contiguous = offset, [], True
            for header, found in zip(answer.message.headers, answer.message.found):
                if not found:
                    message.headers.add(block_hash=header.block_hash, tail_key=header.tail_key)
                    message.found.append(False)
                    continue
                size, ok = sizes[place], got[place]
                place += 1
                if ok:
                    message.headers.append(header)
                    message.found.append(True)
                    parts.append(memoryview(buffer)[offset:offset + size])
                else:  # the index names it, the plane lost it: the reader recomputes
                    message.headers.add(block_hash=header.block_hash, tail_key=header.tail_key)
                    message.found.append(False)
                    contiguous = False
                offset += size
            data = memoryview(buffer)[start:offset] if contiguous else memoryview(b"".join(parts))
            decoded.append(Decoded(message, data))
        return decoded

    def _put_bytes(self, keys: list[str], views: list[memoryview]) -> None:
        if not keys:
            return
        arrays = [_address(v) for v in views]
        base, end = _span(arrays)
        if end - base > 2 * sum(v.nbytes for v in views):  # views of separate buffers: gather them
            joined = np.frombuffer(b"".join(views), dtype=np.uint8)
            offsets = np.cumsum([0, *[v.nbytes for v in views[:-1]]])
            arrays = [(joined, joined.ctypes.data + int(o)) for o in offsets]
            base, end = joined.ctypes.data, joined.ctypes.data + joined.nbytes
        ptrs, sizes = [a for _, a in arrays], [v.nbytes for v in views]
        # bytes a read brought (a view of a read buffer) are registered already, and stay so
        registered = self._reads.covers(base, end - base)
        if not registered:
            self._register(base, end - base)
        try:
            codes = self._with_failover("put", lambda todo: self._transfer(
                "put", self._plane.batch_put_from, [keys[i] for i in todo], [ptrs[i] for i in todo],
                [sizes[i] for i in todo], self._replicate), len(keys), lambda code, i: code >= 0)
        finally:
            if not registered:
                _plane_call("unregister", self._plane.unregister_buffer, base)
        failed = [(k, c) for k, c in zip(keys, codes) if c < 0]
        if failed:
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                               f"Mooncake Store refused {len(failed)} of {len(keys)} blocks (first: code "
                               f"{failed[0][1]} for {failed[0][0]}); nothing was indexed")

    def _get_bytes(self, keys: list[str], buffer: np.ndarray, sizes: list[int], registered: bool) -> list[bool]:
        """Into `buffer`, the objects back to back; `registered`: the buffer is registered
        with the transfer engine already (one of ReadBuffers'), else only for this call."""
        if not keys:
            return []
        base = buffer.ctypes.data
        ptrs = [base + int(o) for o in np.cumsum([0, *sizes[:-1]])]
        if not registered:
            self._register(base, buffer.nbytes)
        try:
            codes = self._with_failover("get", lambda todo: self._transfer(
                "get", self._plane.batch_get_into, [keys[i] for i in todo], [ptrs[i] for i in todo],
                [sizes[i] for i in todo]), len(keys), lambda code, i: code == sizes[i])
        finally:
            if not registered:
                _plane_call("unregister", self._plane.unregister_buffer, base)
        ok = [code == size for code, size in zip(codes, sizes)]
        if not all(ok):
            lost = [(k, c) for k, c, good in zip(keys, codes, ok) if not good]
            logger.warning("Mooncake Store lost %d of %d indexed blocks (first: code %d for %s); they are recomputed",
                           len(lost), len(keys), lost[0][1], lost[0][0])
        return ok

    def _with_failover(self, what: str, call, count: int, succeeded) -> list[int]:
        """`call(indices)` -> codes for those indices, tried again for the ones that failed
        with TRANSFER_FAIL while the settings' failover time lasts (replicas > 1 only): a
        dead node's replicas are read until the master drops it, the others after that."""
        codes = call(list(range(count)))
        deadline = time.monotonic() + (self.settings.failover_s if self.settings.replicas > 1 else 0)
        while True:
            todo = [i for i in range(count) if not succeeded(codes[i], i) and codes[i] == TRANSFER_FAIL]
            if not todo or time.monotonic() >= deadline:
                return codes
            logger.info("Mooncake %s of %d blocks hit a node that is gone; trying their other replicas", what,
                        len(todo))
            time.sleep(_FAILOVER_POLL_S)
            for i, code in zip(todo, call(todo)):
                codes[i] = code

    def _transfer(self, what: str, method, *args):
        """`method(*args)`, a Mooncake transfer, on a waiter thread of low priority (see
        the module's docstring); this thread sleeps until it is done."""
        return _plane_call(what, lambda: self._waiters.submit(method, *args).result())

    def _register(self, base: int, size: int) -> None:
        code = _plane_call("register", self._plane.register_buffer, base, size)
        if code != 0:
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"Mooncake could not register {size} bytes: code {code}")

    # ---- one block per message, for tools: the same paths ----------------------------
    def put(self, requests: list[kvstore_pb2.PutRequest]) -> kvstore_pb2.PutResponse:
        for i, r in enumerate(requests):  # checked here: the kvstore sees the headers only
            if len(r.block.data) != block_nbytes(r.block.header):
                raise KVStoreError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"put[{i}].block.data: has {len(r.block.data)} bytes, its header says "
                                   f"{block_nbytes(r.block.header)}")
        lease_id = next((r.lease_id for r in requests if r.lease_id), "")
        message = kvstore_pb2.PutBlocksRequest(lease_id=lease_id)
        message.headers.extend(r.block.header for r in requests)
        return self.put_blocks([OutBatch(message, [b"".join(r.block.data for r in requests)])])

    def get(self, request: kvstore_pb2.GetRequest) -> list[kvstore_pb2.KVBlock]:
        blocks = []
        for answer in self.get_blocks(request):
            offset = 0
            for header, found in zip(answer.message.headers, answer.message.found):
                size = block_nbytes(header) if found else 0
                blocks.append(kvstore_pb2.KVBlock(header=header, data=bytes(answer.data[offset:offset + size]),
                                                  found=found))
                offset += size
        return blocks

    def close(self) -> None:
        self._waiters.shutdown(wait=True)
        self._reads.close()
        try:
            self._plane.close()
        except Exception as e:
            logger.warning("closing the Mooncake client failed: %s", e)


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
        with self._lock:
            return any(a <= address and address + size <= a + b.nbytes for a, b in self._blocks.items())

    def _collect(self) -> None:  # lock held
        while self._released:
            address = self._released.popleft()
            if address in self._blocks:
                self._free.add(address)

    def _new_block(self, size: int) -> int | None:  # lock held
        held = sum(b.nbytes for b in self._blocks.values())
        for address in sorted(self._free, key=lambda a: self._blocks[a].nbytes):
            if held + size <= self._max_bytes:
                break
            held -= self._blocks[address].nbytes
            self._drop(address)
        if held + size > self._max_bytes or self._closed:
            return None
        block = np.empty(size, dtype=np.uint8)
        address = block.ctypes.data
        code = _plane_call("register", self._plane().register_buffer, address, size)
        if code != 0:
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"Mooncake could not register {size} bytes: code {code}")
        self._blocks[address] = block
        return address

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


def _lower_priority(nice: int) -> None:
    """Sets this thread's nice value (Linux keeps one per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as e:  # not Linux, or not allowed: waits at the caller's priority
        logger.debug("could not lower the Mooncake transfer waiter's priority: %s", e)


def _plane_call(what: str, method, *args):
    """A Mooncake call whose failure the workers handle as any kvstore failure (a
    grpc.RpcError: the reader recomputes, the writer ends its write failed)."""
    try:
        return method(*args)
    except Exception as e:  # pybind raises RuntimeError and others: all are the plane's
        raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"Mooncake Store {what} failed: {e}") from None


def _span(arrays: list[tuple[np.ndarray, int]]) -> tuple[int, int]:
    """The one address range holding every view: the export layout puts a put's blocks
    back to back in one buffer, so one registration covers them."""
    base = min(address for _, address in arrays)
    end = max(address + array.nbytes for array, address in arrays)
    return base, end
