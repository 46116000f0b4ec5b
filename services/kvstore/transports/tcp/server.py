"""The kvstore's TCP listener: PutBlocks and GetBlocks framed as in transports/tcp/frames.py, answered
by the same handlers as gRPC (so a read waits on a pending write exactly as GetBlocks
does, and a put is validated and stored exactly as PutBlocks is).

A thread per connection: the kernel copies the bytes with the GIL released (recv_into,
sendmsg), the store's calls block (a lock, a lease's pending write), and a connection's
requests run one after another. At most `max_connections` at once; more are closed.

    accept ──▶ [TLS handshake] ──▶ hello (token, within HELLO_TIMEOUT_S) ──▶ requests ... until EOF
    PutBlocks: each block's bytes read into a buffer of its own, which the memory store then
               keeps as it is (no copy apart, no message holding other blocks alive)
    GetBlocks: the stored blocks' bytes handed to sendmsg as they are (no join)

A bad frame is answered with an error naming its field and the connection is closed; a
client that goes away mid-frame (killed, its connection reset) loses its connection only.
"""
from __future__ import annotations

import logging
import socket
import threading

import grpc

from pdserve.services.common.auth import bearer_problem
from pdserve.services.common.security import INTERNAL_TOKEN
from pdserve.services.common.tls import ServerTLS
from pdserve.services.kvstore.transports.tcp import frames
from pdserve.services.kvstore.batch_codec import Decoded
from pdserve.services.kvstore.errors import InvalidArgument, KVStoreError, KVStoreFullError
from pdserve.services.kvstore.handlers import KVStoreHandlers
from pdserve.services.kvstore.transports.tcp.frames import BadFrame, Header
from pdserve.services.kvstore.validate import block_nbytes
from pdserve.services.pb import kvstore_pb2 as pb

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # to connect (TLS included) and say hello: a silent peer holds no thread longer
IO_TIMEOUT_S = 60.0     # a frame stalled this long mid-way closes its connection; idle ones stay
MAX_CONNECTIONS = 256


class TcpKVStoreServer:
    def __init__(self, handlers: KVStoreHandlers, host: str, port: int = 0, tokens: tuple[str, ...] = (),
                 tls: ServerTLS | None = None, max_connections: int = MAX_CONNECTIONS):
        """`tokens`: a connection's hello must carry one of them (none: any caller).
        `tls`: the gRPC port's certificates (and client CA, for mTLS) serve this port too."""
        self.handlers = handlers
        self._tokens, self._max_connections = tokens, max_connections
        self._tls = tls.ssl_context() if tls is not None else None
        self._listener = socket.create_server((host, port), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._stopped = False
        self._acceptor = threading.Thread(target=self._accept, name="kvstore-tcp-accept", daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
        _shutdown(self._listener)  # wakes accept()
        self._listener.close()
        self._acceptor.join(timeout=10)
        for sock in connections:
            _shutdown(sock)  # wakes its thread's recv; the thread closes it

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                admitted = not self._stopped and len(self._connections) < self._max_connections
                if admitted:
                    self._connections.add(sock)
            if not admitted:
                logger.warning("TCP connection refused: %d connections already", self._max_connections)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock,), name="kvstore-tcp", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """One connection: the hello, then requests one after another until the client goes away."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.settimeout(HELLO_TIMEOUT_S)
            if self._tls is not None:
                sock = self._wrap(sock)
            self._admit(sock)
            sock.settimeout(IO_TIMEOUT_S)
            head = memoryview(bytearray(frames.HEADER.size))
            while (header := self._next_header(sock, head)) is not None:
                self._answer(sock, header)
        except BadFrame as e:
            logger.warning("TCP connection closed: %s", e.error)
            _try_send(sock, frames.error_frame(e.error))
        except OSError as e:  # reset, closed, timed out mid-frame, a failed TLS handshake
            logger.debug("TCP connection ended: %s", e)
        except Exception:  # a bug: this connection ends, the server serves on
            logger.exception("TCP connection failed")
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()

    def _wrap(self, sock: socket.socket) -> socket.socket:
        tls = self._tls.wrap_socket(sock, server_side=True)  # the handshake, under the hello's timeout
        with self._lock:
            self._connections.discard(sock)
            self._connections.add(tls)
        return tls

    def _admit(self, sock) -> None:
        """Reads the hello (its length checked before the token is read) and answers
        HELLO_OK; a wrong or missing token is a BadFrame: refused, the connection closed."""
        hello = self._read_header(sock, memoryview(bytearray(frames.HEADER.size)))
        hello.check((frames.HELLO,), frames.MAX_TOKEN_BYTES, 0)
        token = bytes(frames.recv_bytes(sock, hello.message_len))
        problem = bearer_problem(b"Bearer " + token if token else None, self._tokens, INTERNAL_TOKEN) \
            if self._tokens else None
        if problem is not None:
            raise BadFrame(KVStoreError(grpc.StatusCode.UNAUTHENTICATED, problem))
        frames.send_all(sock, frames.frame(frames.HELLO_OK))

    def _next_header(self, sock, head: memoryview) -> Header | None:
        """The next request's header; None when the client closed the connection between
        requests (or the server stops). An idle connection waits as long as it likes."""
        while True:
            try:
                got = sock.recv_into(head, len(head))
                break
            except TimeoutError:
                if self._stopped:
                    return None
        if got == 0:
            return None
        frames.recv_exactly(sock, head[got:])  # the rest of a begun frame, under the I/O timeout
        return frames.unpack(head)

    def _read_header(self, sock, head: memoryview) -> Header:
        frames.recv_exactly(sock, head)
        return frames.unpack(head)

    def _answer(self, sock, header: Header) -> None:
        """Reads one request whole, then answers it: a refusal leaves the stream in step."""
        # the data length is checked by kind: a put's against the capacity, a get carries none
        header.check((frames.PUT_BLOCKS, frames.PUT_END, frames.GET_BLOCKS), frames.MAX_MESSAGE_BYTES, 1 << 63)
        if header.kind == frames.GET_BLOCKS:
            request = self._read_message(sock, header, pb.GetRequest)
            answer = lambda: self._batch(self.handlers.get_blocks(request, "tcp"))  # noqa: E731
        else:
            requests = self._read_put_stream(sock, header)
            answer = lambda: frames.frame(frames.PUT_REPLY, self.handlers.put_blocks(requests, "tcp"))  # noqa: E731
        try:
            reply = answer()
        except KVStoreError as e:
            reply = frames.error_frame(e)
        except Exception as e:  # a bug or a backend error: answer, as gRPC would, not hang the client
            logger.exception("TCP %s request failed", frames.KIND_NAMES[header.kind])
            reply = frames.error_frame(KVStoreError(grpc.StatusCode.UNKNOWN, repr(e)))
        frames.send_all(sock, reply)

    def _read_message(self, sock, header: Header, message_type):
        if message_type is pb.GetRequest and header.data_len:
            raise BadFrame(InvalidArgument("frame.data_length", f"{header.data_len}: a GET_BLOCKS frame "
                                                                       "carries no data"))
        return frames.parse(frames.recv_bytes(sock, header.message_len), message_type)

    def _read_put_stream(self, sock, header: Header) -> list[Decoded]:
        """PUT_BLOCKS frames up to PUT_END, their bytes read; the stream's bytes together
        within the store's capacity (a put above it could never be stored)."""
        requests, head, total = [], memoryview(bytearray(frames.HEADER.size)), 0
        capacity = self.handlers.store.capacity_bytes
        while header.kind != frames.PUT_END:
            header.check((frames.PUT_BLOCKS, frames.PUT_END), frames.MAX_MESSAGE_BYTES, 1 << 63)
            total += header.data_len
            if total > capacity:  # it could never be stored: refused before a byte of it is read
                self.handlers.metrics.puts_rejected_total.labels("full").inc()
                raise BadFrame(KVStoreFullError(f"frame.data_length: {header.data_len} bytes is above the limit of "
                                                f"{capacity - total + header.data_len} (the store's capacity, less "
                                                "this put's earlier frames); nothing was stored"))
            message = self._read_message(sock, header, pb.PutBlocksRequest)
            requests += self._read_blocks(sock, message, header.data_len)
            header = self._read_header(sock, head)
        if header.message_len or header.data_len:
            raise BadFrame(InvalidArgument("frame.message_length", "a PUT_END frame carries nothing"))
        return requests

    def _read_blocks(self, sock, message: pb.PutBlocksRequest, data_len: int) -> list[Decoded]:
        """The frame's blocks, each read into a buffer of its own and given to the handler
        as a message of one block (as gRPC's one block per message): the memory store
        keeps each buffer as it is. Bytes that disagree with the headers are read whole
        and handed over as one message, for the handler to refuse naming the field."""
        sizes = [block_nbytes(h) for h in message.headers]
        if sum(sizes) != data_len or 0 in sizes:
            return [Decoded(message, memoryview(frames.recv_bytes(sock, data_len)))]
        headers = list(message.headers)
        message.ClearField("headers")
        requests = []
        for header, size in zip(headers, sizes):
            one = pb.PutBlocksRequest()
            one.CopyFrom(message)
            one.headers.append(header)
            requests.append(Decoded(one, memoryview(frames.recv_bytes(sock, size))))
        return requests

    def _batch(self, batches) -> list:
        """The handlers' KVBlockBatch answers as one BATCH frame: their headers in one
        message, the stored bytes after it as they are."""
        message, buffers = pb.KVBlockBatch(), []
        for batch in batches:
            message.headers.extend(batch.message.headers)
            message.found.extend(batch.message.found)
            buffers += batch.buffers
        body = message.SerializeToString()
        data_len = sum(memoryview(b).nbytes for b in buffers)
        return [frames.header(frames.BATCH, len(body), data_len), body, *buffers]


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or already closed


def _try_send(sock, buffers) -> None:
    try:
        frames.send_all(sock, buffers)
    except OSError:
        pass  # the peer is gone: nobody to tell
