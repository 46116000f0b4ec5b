"""transport="mooncake": a worker's blocks go straight between its buffers and Mooncake
Store (services/kvstore/transports/mooncake/plane.py); the kvstore sees only their headers.

    put_blocks: register the export buffer, batch_put_from every block under its object
                key (replicated as the plane says), then PutBlocks(headers, bytes_in_data_plane)
                so the kvstore indexes (and pins, under a lease) what is now there
    get_blocks: GetBlocks(headers_only) says which blocks exist (after waiting for a pending
                write, as before), then batch_get_into one registered buffer; a block the
                plane lost is reported not found, so the reader recomputes it

The bytes are copied once, by Mooncake's transfer engine (its own threads), between the
worker's memory and a store node's segment: no Python, no protobuf, no kvstore process.

Reads land in buffers kept from one get to the next (ReadBuffers, transports/mooncake/buffers.py):
registered with the transfer engine once, their pages already mapped. A fresh buffer per
read cost more than the transfer itself here: the first write to each 4 KiB page faults
(about 5 us a page on this machine, 55 ms for 45 MiB, against about 30 ms to move the
bytes).

A transfer is waited for on a thread of low priority (nice TRANSFER_WAIT_NICE): Mooncake's
client waits for its transfers by polling their status without pause (perf: about 60 %
of the client's CPU samples in clock_gettime, a mutex and getTransferStatus), which takes a
core from the threads that move the bytes (its own TCP thread, the store node's) when
cores are few. At nice 19 the poll runs when a core is free, and still within a
scheduler period when none is: on 2 cores, transfers took 20-35 % less time.

With a store node on this host (`local`, transports/mooncake/local.py) no byte crosses TCP: the
worker is that node's dummy client. Its read buffers and the engine's export buffers
(export_buffer) are shared memory the node maps (ShmBuffers); a put or get is
one RPC naming offsets in them, and the node memcpys between them and its segment (or
sends over its own transfer engine to a replica elsewhere). Bytes that are not in that
memory are copied into it first, or go over TCP when it is full. A node that is gone
(its RPCs fail, RPC_FAIL; or it restarted and knows our memory no more, INVALID_PARAMS) is
left for a client of the usual kind (TCP, connected then):
the transfers that failed are done again over it at once, the next ones too, until a
probe finds the node serving again (LocalNode).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from pdserve.services.kvstore.batch_codec import Decoded, OutBatch
from pdserve.services.kvstore.errors import KVStoreError
from pdserve.services.kvstore.transports.mooncake import plane as mooncake_plane
from pdserve.services.kvstore.transports.mooncake.buffers import ReadBuffers, ShmBuffers, plane_call as _plane_call
from pdserve.services.kvstore.transports.mooncake.local import LOST_CODES, RPC_FAIL, LocalNode
from pdserve.services.kvstore.transports.mooncake.plane import (READ_BUFFER_BYTES, TRANSFER_FAIL, MooncakeSettings,
                                                                MooncakeUnavailable, object_key, replicate_config)
from pdserve.services.kvstore.transports.base import BlockTransport, GrpcTransport
from pdserve.services.kvstore.validate import block_nbytes, key_for_hash, key_for_tail
from pdserve.services.pb import kvstore_pb2

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

    def __init__(self, control: GrpcTransport, settings: MooncakeSettings, plane=None,
                 read_buffer_bytes: int = READ_BUFFER_BYTES, local: LocalNode | None = None):
        """`control`: the kvstore's gRPC transport, for the index calls; `plane`: a
        connected Mooncake client (mooncake_plane.connect), or None to connect one at its
        first use; `local`: the store node on this host, through which every transfer goes
        while it serves (then `plane` is only the fallback); `read_buffer_bytes`: how much
        memory the read (and, with `local`, export) buffers kept between calls may hold."""
        self._control, self.settings, self._plane = control, settings, plane
        self._plane_lock = threading.Lock()
        self._local = local
        self._replicate = replicate_config(settings)
        if local is not None:
            self._reads: ReadBuffers = ShmBuffers(local.client, read_buffer_bytes)
            local.on_back = self._reads.switch
            self._reads.on_close = self._forget_for_tcp
        else:
            self._reads = ReadBuffers(lambda: self._plane, read_buffer_bytes)
        self._tcp_blocks: set[int] = set()  # with `local`: its blocks registered with `plane` too, for fallback
        self._waiters = ThreadPoolExecutor(_TRANSFER_WAITERS, "mooncake-transfer", initializer=_lower_priority,
                                           initargs=(mooncake_plane.TRANSFER_WAIT_NICE,))

    @property
    def local(self) -> LocalNode | None:
        return self._local

    def export_buffer(self, nbytes: int) -> np.ndarray | None:
        """With a local store node: shared memory it reads a put from in place (the engine
        exports into it, and the put moves it with one memcpy in the node). Else None."""
        if self._local is None or not self._local.up or nbytes <= 0:
            return None
        view, in_pool = self._reads.take(nbytes)
        return view if in_pool else None

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
        buffer, _ = self._reads.take(sum(sizes))
        got = self._get_bytes([object_key(_store_key(h), h.checksum) for _, _, h in wanted], buffer, sizes)
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
        staged = None
        if self._local is not None and self._local.up and not self._reads.covers(base, end - base):
            # not in the memory the local node maps (the engine exported elsewhere): one copy into it
            staged, in_pool = self._reads.take(end - base)
            if in_pool:  # view by view: what lies between them may not be readable memory
                for view, ptr in zip(views, ptrs):
                    staged[ptr - base:ptr - base + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
                ptrs = [staged.ctypes.data + (p - base) for p in ptrs]
                base, end = staged.ctypes.data, staged.ctypes.data + staged.nbytes
        codes = self._with_failover("put", lambda todo: self._move("put", keys, ptrs, sizes, todo, base, end - base),
                                    len(keys), lambda code, i: code >= 0)
        del staged  # kept to here: the pool block is free again once nothing views it
        failed = [(k, c) for k, c in zip(keys, codes) if c < 0]
        if failed:
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                               f"Mooncake Store refused {len(failed)} of {len(keys)} blocks (first: code "
                               f"{failed[0][1]} for {failed[0][0]}); nothing was indexed")

    def _get_bytes(self, keys: list[str], buffer: np.ndarray, sizes: list[int]) -> list[bool]:
        """Into `buffer`, the objects back to back."""
        if not keys:
            return []
        base = buffer.ctypes.data
        ptrs = [base + int(o) for o in np.cumsum([0, *sizes[:-1]])]
        codes = self._with_failover("get", lambda todo: self._move("get", keys, ptrs, sizes, todo, base,
                                                                   buffer.nbytes),
                                    len(keys), lambda code, i: code == sizes[i])
        ok = [code == size for code, size in zip(codes, sizes)]
        if not all(ok):
            lost = [(k, c) for k, c, good in zip(keys, codes, ok) if not good]
            logger.warning("Mooncake Store lost %d of %d indexed blocks (first: code %d for %s); they are recomputed",
                           len(lost), len(keys), lost[0][1], lost[0][0])
        return ok

    def _move(self, what: str, keys: list[str], ptrs: list[int], sizes: list[int], todo: list[int], base: int,
              span: int) -> list[int]:
        """The transfers `todo` (indices), their memory within [base, base + span): through
        the local store node when there is one, it serves and the memory is its shared
        memory; else, and for those it failed as gone, over the TCP client."""
        def pick(indices):
            return [keys[i] for i in indices], [ptrs[i] for i in indices], [sizes[i] for i in indices]
        codes, redo = [RPC_FAIL] * len(todo), list(range(len(todo)))
        local = self._local
        if local is not None and local.up and self._reads.covers(base, span):
            try:
                # on this thread: the dummy client waits on its RPC without polling (the node
                # moves the bytes), so a waiter thread at low priority would only add latency
                codes = _plane_call(what, local.put if what == "put" else local.get, *pick(todo))
            except KVStoreError as e:  # the dummy client raised: as gone
                logger.warning("the local Mooncake store node failed a %s: %s", what, e.details())
            redo = [j for j, code in enumerate(codes) if code in LOST_CODES]
            if not redo:
                return codes
            local.gone()
        plane = self._tcp_plane()
        with self._registered_for_tcp(plane, base, span):
            keys_, ptrs_, sizes_ = pick([todo[j] for j in redo])
            if what == "put":
                again = self._transfer("put", plane.batch_put_from, keys_, ptrs_, sizes_, self._replicate)
            else:
                again = self._transfer("get", plane.batch_get_into, keys_, ptrs_, sizes_)
        for j, code in zip(redo, again):
            codes[j] = code
        return codes

    def _tcp_plane(self):
        """The Mooncake client of the usual kind (the transfer engine over TCP or RDMA),
        connected at its first use."""
        with self._plane_lock:
            if self._plane is None:
                try:
                    self._plane = mooncake_plane.connect(self.settings)
                except MooncakeUnavailable as e:
                    raise KVStoreError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            return self._plane

    @contextlib.contextmanager
    def _registered_for_tcp(self, plane, base: int, size: int):
        """[base, base + size) registered with the TCP client's transfer engine for the
        block: a kept buffer's block once and for good, other memory for this call only."""
        if self._local is None and self._reads.covers(base, size):
            yield  # a read buffer of the TCP client: registered already, and stays so
            return
        block = self._reads.block_of(base, size) if self._local is not None else None
        if block is not None:
            with self._plane_lock:
                if block[0] not in self._tcp_blocks:
                    self._register(plane, *block)
                    self._tcp_blocks.add(block[0])
            yield
            return
        self._register(plane, base, size)
        try:
            yield
        finally:
            _plane_call("unregister", plane.unregister_buffer, base)

    def _forget_for_tcp(self, addresses: list[int]) -> None:
        """Blocks of a dummy client about to close (ShmBuffers.on_close), unregistered from
        the TCP client's transfer engine: their memory is unmapped next."""
        with self._plane_lock:
            for address in addresses:
                if address in self._tcp_blocks:
                    self._tcp_blocks.discard(address)
                    try:
                        self._plane.unregister_buffer(address)
                    except Exception as e:  # the client closing: nothing to keep registered
                        logger.debug("unregistering a retired block from the TCP client failed: %s", e)

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

    @staticmethod
    def _register(plane, base: int, size: int) -> None:
        code = _plane_call("register", plane.register_buffer, base, size)
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
        for what, client in (("the local store node's", self._local), ("the Mooncake client", self._plane)):
            if client is None:
                continue
            try:
                client.close()
            except Exception as e:
                logger.warning("closing %s failed: %s", what, e)


def _lower_priority(nice: int) -> None:
    """Sets this thread's nice value (Linux keeps one per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as e:  # not Linux, or not allowed: waits at the caller's priority
        logger.debug("could not lower the Mooncake transfer waiter's priority: %s", e)


def _span(arrays: list[tuple[np.ndarray, int]]) -> tuple[int, int]:
    """The one address range holding every view: the export layout puts a put's blocks
    back to back in one buffer, so one registration covers them."""
    base = min(address for _, address in arrays)
    end = max(address + array.nbytes for array, address in arrays)
    return base, end
