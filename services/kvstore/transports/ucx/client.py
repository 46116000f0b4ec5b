"""Put and Get over UCX (transports/ucx/frames.py), on a pool of endpoints per client.

One request at a time per endpoint, since frames of two requests must not interleave;
a pool rather than one endpoint behind a lock, because a Get may wait on the server for
a pending write (seconds) and must not hold up the other threads' calls meanwhile. An
endpoint goes back to the pool after its request; a failed or timed-out call drops it
(it may be out of step with the server) and a later call connects anew.
"""
from __future__ import annotations

import threading

import grpc

from pdserve.services.kvstore.transports.ucx import frames
from pdserve.services.kvstore.transports.ucx import runtime as ucx_runtime
from pdserve.services.kvstore.batch_codec import BATCH_BYTES, Decoded, OutBatch
from pdserve.services.kvstore.errors import KVStoreError
from pdserve.services.kvstore.transports.base import BlockTransport
from pdserve.services.kvstore.transports.ucx.runtime import ucxx  # imported there, after the environment it reads
from pdserve.services.pb import kvstore_pb2

CONNECT_TIMEOUT_S = 5.0


class UcxTransport(BlockTransport):
    # Many blocks per PutBlocks message: each UCX message costs a round on the event loop
    # (measured: one block per message is slower here than the store's copy of a batch).
    put_batch_bytes = BATCH_BYTES

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None = None):
        """`token`: the internal token, sent in each connection's hello."""
        self.host, self.port, self._timeout_s = host, port, timeout_s
        self._hello = frames.hello_frame(token)
        self._lock = threading.Lock()
        self._idle: list = []  # connected endpoints no request is using

    def put(self, requests):
        return self._request(lambda endpoint: self._put(endpoint, requests))

    def get(self, request):
        return self._request(lambda endpoint: self._get(endpoint, request))

    def put_blocks(self, batches):
        return self._request(lambda endpoint: self._put_blocks(endpoint, batches))

    def get_blocks(self, request):
        # a Get may wait for a pending write first: its time comes on top
        return self._request(lambda endpoint: self._get_blocks(endpoint, request),
                             self._timeout_s + request.wait_ms / 1000)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for endpoint in idle:
            self._abort(endpoint)

    def _request(self, exchange, timeout_s: float | None = None):
        """Runs `exchange(endpoint)` on an idle endpoint, or a new one."""
        timeout_s = timeout_s or self._timeout_s
        with self._lock:
            slot = [self._idle.pop() if self._idle else None]
        try:
            result = ucx_runtime.run(self._on(slot, exchange), timeout=timeout_s)
        except TimeoutError:
            self._abort(slot[0])
            raise KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"no UCX answer from {self.host}:{self.port} in {timeout_s} s") from None
        except ucxx.exceptions.UCXError as e:
            self._abort(slot[0])
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"UCX to {self.host}:{self.port}: {e}") from e
        except KVStoreError:  # the server's answer (an error frame): the endpoint is in step
            self._reuse(slot[0])
            raise
        self._reuse(slot[0])
        return result

    async def _on(self, slot: list, exchange):
        if slot[0] is None:
            try:
                slot[0] = await ucxx.create_endpoint(self.host, self.port,
                                                     connect_timeout=min(CONNECT_TIMEOUT_S, self._timeout_s))
            except TimeoutError:  # nobody answered the handshake: unreachable, not slow
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                   f"cannot connect over UCX to {self.host}:{self.port}") from None
            await self._greet(slot)
        return await exchange(slot[0])

    async def _greet(self, slot: list) -> None:
        """The hello (transports/ucx/frames.py); a refusal drops the endpoint, which the server closes."""
        await slot[0].send(self._hello)
        reply = await slot[0].recv_obj()
        if frames.kind_of(reply) != frames.HELLO_OK:
            endpoint, slot[0] = slot[0], None  # not pooled: the server has closed it
            endpoint.abort()
            _raise_if_error(reply)
            raise KVStoreError(grpc.StatusCode.UNKNOWN, f"UCX {self.host}:{self.port}: no answer to the hello")

    def _reuse(self, endpoint) -> None:
        if endpoint is not None:
            with self._lock:
                self._idle.append(endpoint)

    def _abort(self, endpoint) -> None:
        """Aborts the endpoint on the UCX loop (ucxx objects belong to that thread)."""
        if endpoint is not None:
            ucx_runtime.run(_abort(endpoint), timeout=self._timeout_s)

    async def _put(self, endpoint, requests: list[kvstore_pb2.PutRequest]) -> kvstore_pb2.PutResponse:
        for request in requests:
            await endpoint.send_obj(frames.frame(frames.PUT, request))
        await endpoint.send_obj(frames.frame(frames.PUT_END))
        reply = await endpoint.recv_obj()
        _raise_if_error(reply)
        return frames.parse(reply, kvstore_pb2.PutResponse)

    async def _get(self, endpoint, request: kvstore_pb2.GetRequest) -> list[kvstore_pb2.KVBlock]:
        await endpoint.send_obj(frames.frame(frames.GET, request))
        blocks = []
        while frames.kind_of(reply := await endpoint.recv_obj()) != frames.GET_END:
            _raise_if_error(reply)
            blocks.append(frames.parse(reply, kvstore_pb2.KVBlock))
        return blocks

    async def _put_blocks(self, endpoint, batches: list[OutBatch]) -> kvstore_pb2.PutResponse:
        for batch in batches:
            await frames.send_batch(endpoint, frames.PUT_BLOCKS, batch)
        await endpoint.send_obj(frames.frame(frames.PUT_END))
        reply = await endpoint.recv_obj()
        _raise_if_error(reply)
        return frames.parse(reply, kvstore_pb2.PutResponse)

    async def _get_blocks(self, endpoint, request: kvstore_pb2.GetRequest) -> list[Decoded]:
        await endpoint.send_obj(frames.frame(frames.GET_BLOCKS, request))
        batches = []
        while frames.kind_of(reply := await endpoint.recv_obj()) != frames.GET_END:
            _raise_if_error(reply)
            sizes = frames.batch_sizes(reply)
            raw = await frames.recv_raw(endpoint, sizes)
            batches.append(Decoded(frames.parse_batch_frame(reply, kvstore_pb2.KVBlockBatch, len(sizes)), raw))
        return batches


def _raise_if_error(reply) -> None:
    if frames.kind_of(reply) == frames.ERROR:
        raise frames.parse_error(reply)


async def _abort(endpoint) -> None:
    endpoint.abort()
