"""Put and Get over UCX (ucx_frames.py), on one endpoint per client.

One request at a time per endpoint (a lock), since frames of two requests must not
interleave. A failed or timed-out call drops the endpoint, which may be out of step with
the server; the next call connects again.
"""
from __future__ import annotations

import threading

import grpc

from services.kvstore import ucx_frames as frames
from services.kvstore import ucx_runtime
from services.kvstore.errors import KVStoreError
from services.kvstore.transport import BlockTransport
from services.kvstore.ucx_runtime import ucxx  # imported there, after the environment it reads
from services.pb import kvstore_pb2

CONNECT_TIMEOUT_S = 5.0


class UcxTransport(BlockTransport):
    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self._timeout_s = host, port, timeout_s
        self._lock = threading.Lock()
        self._endpoint = None

    def put(self, requests):
        return self._request(self._put(requests))

    def get(self, request):
        return self._request(self._get(request))

    def close(self) -> None:
        with self._lock:
            self._drop_endpoint()

    def _request(self, coro):
        with self._lock:
            try:
                return ucx_runtime.run(coro, timeout=self._timeout_s)
            except TimeoutError:
                self._drop_endpoint()
                raise KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no UCX answer from {self.host}:{self.port} in {self._timeout_s} s") from None
            except ucxx.exceptions.UCXError as e:
                self._drop_endpoint()
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"UCX to {self.host}:{self.port}: {e}") from e

    def _drop_endpoint(self) -> None:
        """Aborts the endpoint on the UCX loop (ucxx objects belong to that thread)."""
        if self._endpoint is not None:
            endpoint, self._endpoint = self._endpoint, None
            ucx_runtime.run(_abort(endpoint), timeout=self._timeout_s)

    async def _connect(self):
        if self._endpoint is None:
            try:
                self._endpoint = await ucxx.create_endpoint(self.host, self.port,
                                                            connect_timeout=min(CONNECT_TIMEOUT_S, self._timeout_s))
            except TimeoutError:  # nobody answered the handshake: unreachable, not slow
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE,
                                   f"cannot connect over UCX to {self.host}:{self.port}") from None
        return self._endpoint

    async def _put(self, requests: list[kvstore_pb2.PutRequest]) -> kvstore_pb2.PutResponse:
        endpoint = await self._connect()
        for request in requests:
            await endpoint.send_obj(frames.frame(frames.PUT, request))
        await endpoint.send_obj(frames.frame(frames.PUT_END))
        reply = await endpoint.recv_obj()
        _raise_if_error(reply)
        return frames.parse(reply, kvstore_pb2.PutResponse)

    async def _get(self, request: kvstore_pb2.GetRequest) -> list[kvstore_pb2.KVBlock]:
        endpoint = await self._connect()
        await endpoint.send_obj(frames.frame(frames.GET, request))
        blocks = []
        while frames.kind_of(reply := await endpoint.recv_obj()) != frames.GET_END:
            _raise_if_error(reply)
            blocks.append(frames.parse(reply, kvstore_pb2.KVBlock))
        return blocks


def _raise_if_error(reply) -> None:
    if frames.kind_of(reply) == frames.ERROR:
        raise frames.parse_error(reply)


async def _abort(endpoint) -> None:
    endpoint.abort()
