"""The kvstore's UCX listener: Put and Get framed as in transports/ucx/frames.py, answered by the
same handlers as gRPC. Store calls block (a lock, a Redis round trip), so they run in the
UCX loop's thread pool and the loop keeps moving bytes for other connections.

The listener binds every interface: ucxx's Python API takes only a port (the C++
ListenerBuilder has a host, not exposed). Clients are told the port, not the host.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.services.common.auth import bearer_problem
from pdserve.services.common.security import INTERNAL_TOKEN
from pdserve.services.kvstore.transports.ucx import frames
from pdserve.services.kvstore.transports.ucx import runtime as ucx_runtime
from pdserve.services.kvstore.batch_codec import Decoded
from pdserve.services.kvstore.errors import InvalidArgument, KVStoreError
from pdserve.services.kvstore.handlers import KVStoreHandlers
from pdserve.services.kvstore.transports.ucx.runtime import ucxx  # imported there, after the environment it reads
from pdserve.services.pb import kvstore_pb2

logger = logging.getLogger(__name__)


class UcxKVStoreServer:
    def __init__(self, handlers: KVStoreHandlers, port: int = 0, tokens: tuple[str, ...] = ()):
        """`tokens`: a connection's hello must carry one of them (none: any caller)."""
        self.handlers = handlers
        self._tokens = tokens
        self._endpoints: set = set()
        self._listener = ucx_runtime.run(self._listen(port), timeout=30)
        self.port: int = self._listener.port

    async def _listen(self, port: int):
        return ucxx.create_listener(self._serve, port)

    def stop(self) -> None:
        ucx_runtime.run(self._close(), timeout=30)

    async def _close(self) -> None:
        self._listener.close()
        for endpoint in list(self._endpoints):
            endpoint.abort()

    async def _serve(self, endpoint) -> None:
        """One connection: requests one after another until the client goes away."""
        self._endpoints.add(endpoint)
        try:
            if not await self._admit(endpoint):
                return
            while True:
                data = await endpoint.recv_obj()
                await self._answer(endpoint, data)
        except (ucxx.exceptions.UCXError, asyncio.CancelledError) as e:
            logger.debug("UCX connection ended: %s", e)
        finally:
            self._endpoints.discard(endpoint)

    async def _admit(self, endpoint) -> bool:
        """Reads the hello; answers K, or refuses and closes the connection."""
        hello = bytearray(frames.HELLO_BYTES)
        await endpoint.recv(hello)
        token = frames.hello_token(hello)
        if token is None:
            problem = "the connection's first frame must be the hello (a client of another version?)"
        elif self._tokens:
            problem = bearer_problem(b"Bearer " + token if token else None, self._tokens, INTERNAL_TOKEN)
        else:
            problem = None
        if problem is None:
            await endpoint.send_obj(frames.frame(frames.HELLO_OK))
            return True
        logger.warning("UCX connection refused: %s", problem)
        await endpoint.send_obj(frames.error_frame(KVStoreError(grpc.StatusCode.UNAUTHENTICATED, problem)))
        await endpoint.close()
        return False

    async def _answer(self, endpoint, data) -> None:
        kind = frames.kind_of(data)
        try:
            if kind == frames.PUT or kind == frames.PUT_END:
                await self._put(endpoint, data)
            elif kind == frames.GET:
                await self._get(endpoint, data)
            elif kind == frames.PUT_BLOCKS:
                await self._put_blocks(endpoint, data)
            elif kind == frames.GET_BLOCKS:
                await self._get_blocks(endpoint, data)
            else:
                raise InvalidArgument("frame", f"kind {kind!r} is not a request")
        except KVStoreError as e:
            await endpoint.send_obj(frames.error_frame(e))
        except ucxx.exceptions.UCXError:
            raise
        except Exception as e:  # a bug or a backend error: answer, as gRPC would, not hang the client
            logger.exception("UCX %r request failed", kind)
            await endpoint.send_obj(frames.error_frame(KVStoreError(grpc.StatusCode.UNKNOWN, repr(e))))

    async def _put(self, endpoint, data) -> None:
        async def parse(frame):
            return frames.parse(frame, kvstore_pb2.PutRequest)
        requests = await self._read_put_stream(endpoint, data, frames.PUT, "Put", parse)
        reply = await _in_thread(self.handlers.put, requests, "ucx")
        await endpoint.send_obj(frames.frame(frames.PUT_REPLY, reply))

    async def _read_put_stream(self, endpoint, data, kind, name: str, parse) -> list:
        """The frames of one put stream up to its end frame, each `parse`d; an invalid one
        is refused after the stream is read to its end, so the next request starts in step."""
        requests, error = [], None
        while frames.kind_of(data) != frames.PUT_END:
            try:
                if frames.kind_of(data) != kind:
                    raise InvalidArgument(f"put[{len(requests)}]", f"a {name} stream holds only {name} frames")
                requests.append(await parse(data))
            except InvalidArgument as e:
                error = error or e
            data = await endpoint.recv_obj()
        if error is not None:
            self.handlers.metrics.puts_rejected_total.labels("invalid").inc()
            raise error
        return requests

    async def _get(self, endpoint, data) -> None:
        request = frames.parse(data, kvstore_pb2.GetRequest)
        blocks = await _in_thread(self.handlers.get, request, "ucx")
        for block in blocks:
            await endpoint.send_obj(frames.frame(frames.BLOCK, block))
        await endpoint.send_obj(frames.frame(frames.GET_END))

    async def _put_blocks(self, endpoint, data) -> None:
        """Q frames, each with its raw data, until E; then one answer."""
        async def parse(frame):
            sizes = frames.batch_sizes(frame)
            raw = await frames.recv_raw(endpoint, sizes)
            return Decoded(frames.parse_batch_frame(frame, kvstore_pb2.PutBlocksRequest, len(sizes)), raw)
        requests = await self._read_put_stream(endpoint, data, frames.PUT_BLOCKS, "PutBlocks", parse)
        reply = await _in_thread(self.handlers.put_blocks, requests, "ucx")
        await endpoint.send_obj(frames.frame(frames.PUT_REPLY, reply))

    async def _get_blocks(self, endpoint, data) -> None:
        request = frames.parse(data, kvstore_pb2.GetRequest)
        for batch in await _in_thread(self.handlers.get_blocks, request, "ucx"):
            await frames.send_batch(endpoint, frames.BATCH, batch)
        await endpoint.send_obj(frames.frame(frames.GET_END))


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
