"""The Python client of the KV cache service, used by prefill and decode workers.

Blocks travel over the chosen transport (gRPC streams by default, raw TCP frames, UCX, or
Mooncake Store straight between the worker and the store nodes, the kvstore indexing them); lookups,
leases and stats always over gRPC. Every failure is a grpc.RpcError with its status code
(from either transport); a Put that does not fit raises KVStoreFullError. One client may
be shared by many threads.

Two ways to move blocks: put_blocks/get_blocks, many blocks per message, their bytes
taken from and viewed in one buffer (what the workers use); put/get, one KVBlock message
per block (simple, for tools and tests).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import grpc

from pdserve.services.common.address import split_host_port
from pdserve.services.common.grpc_server import channel
from pdserve.services.common.security import ClientSecurity
from pdserve.services.kvstore.batch_codec import Decoded, OutBatch
from pdserve.services.kvstore.errors import KVStoreError, KVStoreFullError  # noqa: F401  (part of this API)
from pdserve.services.kvstore.transports.tcp.frames import TCP_PORT_METADATA
from pdserve.services.kvstore.transports.base import BlockTransport, GrpcTransport
from pdserve.services.kvstore.transports.ucx.frames import UCX_PORT_METADATA
from pdserve.services.kvstore.validate import block_nbytes
from pdserve.services.pb import kvstore_pb2, kvstore_pb2_grpc

logger = logging.getLogger(__name__)

TRANSPORTS = ("grpc", "tcp", "ucx", "mooncake")


class KVStoreClient:
    def __init__(self, address: str, transport: str = "grpc", ucx_address: str | None = None,
                 timeout_s: float = 30.0, security: ClientSecurity = ClientSecurity(),
                 channel_options: tuple[tuple[str, int], ...] = (), tcp_address: str | None = None,
                 mooncake_local_node: str = "off"):
        """`ucx_address` / `tcp_address` ("host:port") are only for transport "ucx" / "tcp";
        without one, the port is asked from the server at the first Put or Get, on the host
        of `address`. `security`: the internal token (sent over every transport) and TLS
        (gRPC and TCP; UCX has none).
        `channel_options`: extra gRPC channel options (a worker's reconnect backoff).
        `mooncake_local_node` (transport "mooncake"): the store node on this host to move
        bytes through by shared memory, its service "host:port" (mooncake_client --port); "auto":
        the first the kvstore's plane names on this host; "off": none, every byte over the
        transfer engine (TCP or RDMA). One that cannot be attached to at the first Put or
        Get is logged, and the transfer engine used."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: {transport!r} is not one of {TRANSPORTS}")
        if mooncake_local_node not in ("off", "auto"):
            split_host_port(mooncake_local_node, "mooncake_local_node")
        self._mooncake_local_node = mooncake_local_node
        for name, value in (("ucx_address", ucx_address), ("tcp_address", tcp_address)):
            if value is not None:
                split_host_port(value, name)
        self.address, self.transport = address, transport
        self._ucx_address, self._tcp_address = ucx_address, tcp_address
        self._timeout_s = timeout_s
        self._token, self._tls = security.token, security.tls
        self._channel = channel(address, channel_options, security=security)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._lock = threading.Lock()
        self._blocks: BlockTransport | None = None

    def lookup(self, block_hashes: list[bytes], lease_id: str = "") -> int:
        """How many leading hashes the store holds; under a lease, those are pinned by it."""
        request = kvstore_pb2.LookupRequest(block_hashes=block_hashes, lease_id=lease_id)
        return self._stub.Lookup(request, timeout=self._timeout_s).num_prefix_found

    def create_lease(self, ttl_ms: int, req_id: str = "", write_pending: bool = False) -> str:
        """With write_pending, a get_blocks naming the lease (and a wait) waits for end_write."""
        request = kvstore_pb2.CreateLeaseRequest(ttl_ms=ttl_ms, req_id=req_id, write_pending=write_pending)
        return self._stub.CreateLease(request, timeout=self._timeout_s).lease_id

    def end_write(self, lease_id: str, failed: bool = False) -> bool:
        request = kvstore_pb2.EndWriteRequest(lease_id=lease_id, failed=failed)
        return self._stub.EndWrite(request, timeout=self._timeout_s).ended

    def put_blocks(self, headers: list[kvstore_pb2.KVBlockHeader], data, lease_id: str = "") -> int:
        """Stores the blocks `headers` describe, their bytes back to back in `data` (anything
        C-contiguous with the buffer protocol: a host tensor's .numpy(), bytes, memoryview),
        all or none; returns how many. Each message carries a view of `data`, never a copy
        of a block on its own; how many blocks per message is the transport's choice
        (BlockTransport.put_batch_bytes)."""
        transport = self._block_transport()
        view = memoryview(data).cast("B")
        batches, offset, start = [], 0, 0
        message = None
        for header in headers:
            if message is None or offset - start >= transport.put_batch_bytes:
                if message is not None:
                    batches.append(OutBatch(message, [view[start:offset]]))
                message, start = kvstore_pb2.PutBlocksRequest(lease_id=lease_id), offset
            message.headers.append(header)
            offset += block_nbytes(header)
        if message is not None:
            batches.append(OutBatch(message, [view[start:offset]]))
        if offset != len(view):
            raise ValueError(f"data: has {len(view)} bytes, the headers say {offset}")
        return transport.put_blocks(batches).num_stored

    def get_blocks(self, block_hashes: list[bytes], tail_keys: Sequence[str] = (), lease_id: str = "",
                   wait_ms: int = 0) -> list[Decoded]:
        """The blocks in order, hashes then tails, as KVBlockBatch messages (`.message`:
        headers and found flags; `.data`: the found blocks' bytes, viewed where they were
        received). With a lease and wait_ms, the store first waits for the lease's pending
        write to end, up to wait_ms."""
        request = kvstore_pb2.GetRequest(block_hashes=block_hashes, tail_keys=list(tail_keys),
                                         lease_id=lease_id, wait_ms=wait_ms)
        return self._block_transport().get_blocks(request)

    def put(self, blocks: list[kvstore_pb2.KVBlock], lease_id: str = "") -> int:
        """Stores `blocks` (pinned by the lease, if any), all or none; returns how many."""
        requests = [kvstore_pb2.PutRequest(lease_id=lease_id, block=block) for block in blocks]
        return self._block_transport().put(requests).num_stored

    def get(self, block_hashes: list[bytes], tail_keys: Sequence[str] = ()) -> list[kvstore_pb2.KVBlock]:
        """The blocks in order, hashes then tails; found=False for one the store lacks."""
        request = kvstore_pb2.GetRequest(block_hashes=block_hashes, tail_keys=list(tail_keys))
        return self._block_transport().get(request)

    @property
    def mooncake_local_node(self) -> str:
        return self._mooncake_local_node

    def local_node(self):
        """The Mooncake store node on this host the transport moves bytes through
        (transports/mooncake/local.py LocalNode), or None: none, or not connected yet."""
        return getattr(self._blocks, "local", None) if self.transport == "mooncake" else None

    def export_buffer(self, nbytes: int):
        """Memory to export `nbytes` of KV into, that put_blocks sends without copying it
        (a numpy uint8 array; the transport's, reused once nothing views it), or None: the
        transport has none (all but Mooncake with a local store node), is not connected yet
        (the first put or get connects it: this never waits on the network), or cannot
        give any now. Never raises."""
        transport = self._blocks  # never connected here: the caller is the engine's thread
        if self.transport != "mooncake" or transport is None:
            return None
        try:
            return transport.export_buffer(nbytes)
        except Exception as e:  # the plane away: the engine allocates
            logger.debug("no export buffer from the kvstore's transport: %s", e)
            return None

    def release_lease(self, lease_id: str, drop_tail: bool = True) -> bool:
        """True the first time; False when already released or expired."""
        request = kvstore_pb2.ReleaseLeaseRequest(lease_id=lease_id, drop_tail=drop_tail)
        return self._stub.ReleaseLease(request, timeout=self._timeout_s).released

    def release_lease_quietly(self, lease_id: str) -> bool:
        """release_lease for a caller that cannot act on a failure: the lease then expires
        by itself, only later, so a failure is logged, not raised. No-op for ""."""
        if not lease_id:
            return False
        try:
            return self.release_lease(lease_id, drop_tail=True)
        except grpc.RpcError as e:
            logger.warning("releasing lease %s at %s failed (%s); it expires by itself",
                           lease_id, self.address, e.code())
            return False

    def stats(self) -> kvstore_pb2.KVStoreStats:
        return self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=self._timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._blocks is not None:
                self._blocks.close()
                self._blocks = None
        self._channel.close()

    def _block_transport(self) -> BlockTransport:
        with self._lock:
            if self._blocks is None:
                self._blocks = self._connect()
            return self._blocks

    def _connect(self) -> BlockTransport:
        if self.transport == "grpc":
            return GrpcTransport(self._channel, self._stub, self._timeout_s)
        if self.transport == "mooncake":
            return self._connect_mooncake()
        if self.transport == "tcp":
            from pdserve.services.kvstore.transports.tcp.client import TcpTransport

            def locate() -> tuple[str, int]:
                return split_host_port(self._discover_address(TCP_PORT_METADATA, "TCP", "--tcp-port"), "tcp_address")
            host, port = split_host_port(self._tcp_address, "tcp_address") if self._tcp_address else locate()
            rpc = GrpcTransport(self._channel, self._stub, self._timeout_s)
            return TcpTransport(host, port, self._timeout_s, rpc, self._token, self._tls,
                                locate=None if self._tcp_address else locate)
        # Imported only here: a gRPC-only process never loads UCX.
        from pdserve.services.kvstore.transports.ucx.client import UcxTransport
        address = self._ucx_address or self._discover_address(UCX_PORT_METADATA, "UCX", "--ucx-port")
        host, port = split_host_port(address, "ucx_address")
        return UcxTransport(host, port, self._timeout_s, self._token)

    def _connect_mooncake(self) -> BlockTransport:
        # Imported only here: a worker of a kvstore without a data plane never loads Mooncake.
        from pdserve.services.kvstore.transports.mooncake import plane as mooncake_plane
        from pdserve.services.kvstore.transports.mooncake.client import MooncakeTransport
        _, call = self._stub.Stats.with_call(kvstore_pb2.StatsRequest(), timeout=self._timeout_s)
        found = [value for key, value in call.initial_metadata() if key == mooncake_plane.MOONCAKE_METADATA]
        if not found:
            raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the kvstore at {self.address} has no Mooncake data plane (start it with "
                               "--backend mooncake)")
        settings = mooncake_plane.MooncakeSettings.from_json(found[0])
        local = self._attach_local(settings) if self._mooncake_local_node != "off" else None
        plane = None  # with a local node: connected when it cannot serve
        if local is None:
            try:
                plane = mooncake_plane.connect(settings)
            except mooncake_plane.MooncakeUnavailable as e:
                raise KVStoreError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        return MooncakeTransport(GrpcTransport(self._channel, self._stub, self._timeout_s), settings, plane,
                                 local=local)

    def _attach_local(self, settings):
        """The local store node (mooncake_local_node) attached to, or None."""
        from pdserve.services.kvstore.transports.mooncake import local as mooncake_local
        from pdserve.services.kvstore.transports.mooncake import plane as mooncake_plane
        if self._mooncake_local_node == "auto":
            nodes = mooncake_local.local_store_nodes(settings, split_host_port(self.address, "address")[0])
            if not nodes:
                logger.info("the kvstore's Mooncake plane names no store node on this host: blocks move over %s",
                            settings.protocol)
        else:
            nodes = [self._mooncake_local_node]
        for node in nodes:
            try:
                client = mooncake_local.connect_local(node, mooncake_plane.READ_BUFFER_BYTES)
            except Exception as e:  # MooncakeUnavailable, or the package's own: this node is an optimisation
                logger.warning("%s; blocks move over %s", e, settings.protocol)
                continue
            logger.info("blocks move through the Mooncake store node %s on this host (shared memory)", node)
            return mooncake_local.LocalNode(
                node, client, settings,
                reconnect=lambda: mooncake_local.connect_local(node, mooncake_plane.READ_BUFFER_BYTES))
        return None

    def _discover_address(self, metadata_key: str, name: str, flag: str) -> str:
        """The port the server announces under `metadata_key` (Stats), on its gRPC host."""
        _, call = self._stub.Stats.with_call(kvstore_pb2.StatsRequest(), timeout=self._timeout_s)
        ports = [value for key, value in call.initial_metadata() if key == metadata_key]
        if not ports:
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"the kvstore at {self.address} serves no {name} "
                                                                f"(start it with {flag})")
        return f"{split_host_port(self.address, 'address')[0]}:{ports[0]}"
