"""PutBlocks and GetBlocks over TCP (transports/tcp/frames.py), on a small pool of connections per client.

A put goes out as one PUT_BLOCKS frame: its header and message, then the payload tensor's
memory itself, handed to sendmsg with no join. A get's answer is read straight into one
buffer sized from its headers, which the reader then views as the KVPayload tensor
(torch.frombuffer in kv_wire.py): one copy in all, the kernel's. That buffer comes from
a small pool (ReusedBuffers): memory the process touched before, not fresh pages.

One request at a time per connection; a pool rather than one connection behind a lock,
because a get may wait on the server for a pending write (seconds) and must not hold up
the other threads' calls meanwhile. A connection goes back to the pool after its request
(also after an error answer: the stream is in step); a failure drops it, and a call that
failed on a pooled connection before any answer (the server restarted) is tried once
more on a fresh one. Puts and gets are idempotent, so that retry is safe.

Put and Get (one KVBlock per message, for tools and tests) go over gRPC.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import grpc

from pdserve.services.common.tls import ClientTLS
from pdserve.services.kvstore.transports.tcp import frames
from pdserve.services.kvstore.batch_codec import Decoded, OutBatch
from pdserve.services.kvstore.errors import InvalidArgument, KVStoreError
from pdserve.services.kvstore.transports.reused_buffers import ReusedBuffers
from pdserve.services.kvstore.transports.tcp.frames import BadFrame
from pdserve.services.kvstore.transports.base import BlockTransport
from pdserve.services.kvstore.validate import block_nbytes
from pdserve.services.pb import kvstore_pb2 as pb

CONNECT_TIMEOUT_S = 5.0
POOL_SIZE = 4  # idle connections kept; more may be open while requests are in flight
RECEIVE_BUFFERS = 4  # answers' buffers kept for reuse


class TcpTransport(BlockTransport):
    # Every block in one frame: the server reads each block into a buffer of its own
    # whatever the frame, so more frames would only cost more round trips.
    put_batch_bytes = 1 << 62

    def __init__(self, host: str, port: int, timeout_s: float, rpc: BlockTransport, token: str | None = None,
                 tls: ClientTLS | None = None, locate: Callable[[], tuple[str, int]] | None = None):
        """`rpc` carries Put and Get; `token`: the internal token, sent in each connection's
        hello; `tls`: the trust of the gRPC channel, for this port too. `locate`: asks the
        server for its TCP address again when connecting fails (a restarted kvstore may
        listen on another free port)."""
        self.host, self.port, self._timeout_s, self._rpc = host, port, timeout_s, rpc
        self._locate = locate
        token_bytes = (token or "").encode()
        if len(token_bytes) > frames.MAX_TOKEN_BYTES:
            raise ValueError(f"internal token: {len(token_bytes)} bytes, TCP takes at most {frames.MAX_TOKEN_BYTES}")
        self._hello = [frames.header(frames.HELLO, len(token_bytes)), token_bytes]
        self._tls = tls.ssl_context() if tls is not None else None
        self._server_name = (tls.server_name if tls is not None else None) or host
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._closed = False
        self._buffers = ReusedBuffers(RECEIVE_BUFFERS)

    def put(self, requests):
        return self._rpc.put(requests)

    def get(self, request):
        return self._rpc.get(request)

    def put_blocks(self, batches: list[OutBatch]) -> pb.PutResponse:
        out = []
        for batch in batches:
            body = batch.message.SerializeToString()
            out += [frames.header(frames.PUT_BLOCKS, len(body), batch.num_bytes), body, *batch.buffers]
        out.append(frames.header(frames.PUT_END))
        return self._exchange(out, self._read_put_reply, self._timeout_s)

    def get_blocks(self, request: pb.GetRequest) -> list[Decoded]:
        # a get may wait for a pending write first: its time comes on top
        timeout_s = self._timeout_s + request.wait_ms / 1000
        return [self._exchange(frames.frame(frames.GET_BLOCKS, request), self._read_batch, timeout_s)]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _exchange(self, out: list, read, timeout_s: float):
        """Sends `out` on a pooled connection (or a new one) and returns `read(sock)`."""
        for attempt in (1, 2):
            sock, pooled = self._take()
            try:
                sock.settimeout(timeout_s)
                self._send(sock, out)
                result = read(sock)
            except KVStoreError:  # the server's answer (an ERROR frame): the stream is in step
                self._put_back(sock)
                raise
            except _Refused as e:  # the server's answer, after which it closed the connection
                sock.close()
                raise e.error from None
            except BadFrame as e:
                sock.close()
                raise KVStoreError(grpc.StatusCode.INTERNAL, f"TCP answer from {self._where()}: "
                                                             f"{e.error.details()}") from None
            except TimeoutError:
                sock.close()
                raise KVStoreError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no TCP answer from {self._where()} in {timeout_s} s") from None
            except OSError as e:
                sock.close()
                if pooled and attempt == 1 and isinstance(e, ConnectionError):
                    continue  # the server closed the pooled connection (it restarted): once more, afresh
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"TCP to {self._where()}: {e}") from None
            self._put_back(sock)
            return result
        raise AssertionError("unreachable")

    def _send(self, sock, out: list) -> None:
        """Sends a request; when the server cut it short with an error (a frame it refused,
        then closed), that error is what the caller gets."""
        try:
            frames.send_all(sock, out)
        except OSError as e:
            error = _error_left(sock)
            if error is not None:
                raise _Refused(error) from None
            raise e

    def _take(self) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _put_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < POOL_SIZE:
                self._idle.append(sock)
                return
        sock.close()

    def _connect(self) -> socket.socket:
        """A connection that said hello: refused ones raise the server's error."""
        try:
            sock = self._dial()
        except OSError as e:
            if not self._relocated():
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"cannot connect over TCP to {self._where()}: {e}") \
                    from None
            return self._connect()
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
            frames.send_all(sock, self._hello)
            self._read_reply(sock, frames.HELLO_OK, 0)
            return sock
        except KVStoreError:
            sock.close()
            raise
        except BadFrame as e:
            sock.close()
            raise KVStoreError(grpc.StatusCode.INTERNAL, f"TCP hello to {self._where()}: {e.error.details()}") \
                from None
        except OSError as e:  # reset, timed out, TLS refused
            sock.close()
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"TCP hello to {self._where()}: {e}") from None

    def _dial(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=min(CONNECT_TIMEOUT_S, self._timeout_s))

    def _relocated(self) -> bool:
        """Whether the server now names another TCP address (it restarted elsewhere)."""
        if self._locate is None:
            return False
        try:
            address = self._locate()
        except grpc.RpcError:
            return False  # the gRPC port is down too: the caller's UNAVAILABLE says enough
        with self._lock:
            moved = address != (self.host, self.port)
            if moved:
                self.host, self.port = address
        return moved

    def _read_put_reply(self, sock) -> pb.PutResponse:
        return frames.parse(self._read_reply(sock, frames.PUT_REPLY, 0)[1], pb.PutResponse)

    def _read_batch(self, sock) -> Decoded:
        """A BATCH frame: its headers first, then its bytes into one buffer of the size the
        found blocks' headers give (checked against the frame's before it is allocated)."""
        header, body = self._read_reply(sock, frames.BATCH, 1 << 62)
        message = frames.parse(body, pb.KVBlockBatch)
        expected = sum(block_nbytes(h) for h, found in zip(message.headers, message.found) if found)
        if len(message.found) != len(message.headers) or expected != header.data_len:
            raise BadFrame(InvalidArgument("frame.data_length", f"{header.data_len} bytes, but the headers of "
                                                                       f"its found blocks say {expected}"))
        data = self._buffers.take(header.data_len)
        frames.recv_exactly(sock, data)
        return Decoded(message, data)

    def _read_reply(self, sock, kind: int, max_data: int) -> tuple[frames.Header, bytearray]:
        """The answer's header and message; an ERROR frame raised as its KVStoreError."""
        header = _read_header(sock)
        if header.kind == frames.ERROR:
            header.check((frames.ERROR,), frames.MAX_ERROR_BYTES, 0)
            raise frames.parse_error(frames.recv_bytes(sock, header.message_len))
        header.check((kind,), frames.MAX_MESSAGE_BYTES, max_data)
        return header, frames.recv_bytes(sock, header.message_len)

    def _where(self) -> str:
        return f"{self.host}:{self.port}"


class _Refused(Exception):
    def __init__(self, error: KVStoreError):
        super().__init__(str(error))
        self.error = error


def _read_header(sock) -> frames.Header:
    head = bytearray(frames.HEADER.size)
    frames.recv_exactly(sock, memoryview(head))
    return frames.unpack(head)


def _error_left(sock) -> KVStoreError | None:
    """The ERROR frame a server sent before closing, if it is there to read."""
    try:
        sock.settimeout(1.0)
        header = _read_header(sock)
        if header.kind != frames.ERROR or header.message_len > frames.MAX_ERROR_BYTES:
            return None
        return frames.parse_error(frames.recv_bytes(sock, header.message_len))
    except (OSError, BadFrame):
        return None
