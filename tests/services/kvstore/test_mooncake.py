"""The kvstore's Mooncake Store backend: the kvstore indexes, Mooncake holds the bytes.

Unit tests of the settings, object keys and the index-only requests, then real processes:
a Mooncake master and store nodes (cli/bench/mooncake_cluster.py), killed
with SIGKILL where a test says so. (The client contract over transport "mooncake" is
tests/services/kvstore/test_client.py, parametrized.)"""
from __future__ import annotations

import time

import grpc
import pytest
import torch

from pdserve.engine.kv_transfer import KVLayout, KVPayload, as_tensor
from pdserve.services.kvstore.transports.mooncake import plane as mooncake_plane
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.errors import InvalidArgument
from pdserve.services.kvstore.handlers import KVStoreHandlers
from pdserve.services.kvstore.kv_metrics import KVStoreMetrics
from pdserve.services.kvstore.main import config_from_args, main
from pdserve.services.kvstore.stores.memory import MemoryBlockStore
from pdserve.services.kvstore.transports.mooncake.plane import MooncakeSettings, object_key
from pdserve.services.kvstore.transports.mooncake.client import ReadBuffers
from pdserve.services.kvstore.server import KVStoreConfig, serve
from pdserve.services.kvstore.stores.base import hash_key
from pdserve.services.kvstore.batch_codec import Decoded
from pdserve.services.pb import kvstore_pb2
from pdserve.services.worker.kv_wire import payload_from_batches, payload_to_put
from tests.services.kvstore.conftest import WIRE_BLOCK_BYTES, h, wire_block
from pdserve.cli.bench.mooncake_cluster import MooncakeCluster

SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, heads, head dim
LAYOUT = KVLayout.of("test-model", "float32", SHAPE)


def payload(num_blocks: int, seed: int) -> KVPayload:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randn((num_blocks, *SHAPE), generator=gen)
    hashes = [h(f"s{seed}-b{i}".encode()) for i in range(num_blocks)]
    return KVPayload(num_blocks * SHAPE[2], blocks, hashes)


def put(client: KVStoreClient, p: KVPayload, lease_id: str = "") -> int:
    headers, data = payload_to_put(p, LAYOUT, tail_key="")
    return client.put_blocks(headers, data, lease_id=lease_id)


def read(client: KVStoreClient, p: KVPayload) -> KVPayload | None:
    return payload_from_batches(client.get_blocks(p.block_hashes), p.block_hashes, LAYOUT).payload


# ---- no Mooncake needed ------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    ({"master": "no-port"}, "mooncake_master"),
    ({"metadata_server": "ftp://x"}, "mooncake_metadata"),
    ({"replicas": 0}, "mooncake_replicas"),
    ({"protocol": "udp"}, "mooncake_protocol"),
    ({"rdma_devices": "mlx5_0"}, "mooncake_rdma_devices"),
    ({"failover_s": -1}, "mooncake_failover_s"),
])
def test_settings_refuse_what_cannot_work_naming_the_field(changes, field):
    good = {"master": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata"}
    with pytest.raises(ValueError, match=field):
        MooncakeSettings(**{**good, **changes})


def test_settings_travel_as_json_unchanged():
    settings = MooncakeSettings("10.0.0.1:50100", "http://10.0.0.1:50101/metadata", 2, "rdma", "mlx5_0", 5.0)
    assert MooncakeSettings.from_json(settings.to_json()) == settings


def test_an_object_key_names_the_block_and_its_checksum():
    key = hash_key(h(b"a"))
    assert object_key(key, 1) == object_key(key, 1)
    assert object_key(key, 1) != object_key(key, 2)  # a tail written again with other bytes: a new object
    assert object_key(key, 1) != object_key(hash_key(h(b"b")), 1)


def _index_only(*blocks: kvstore_pb2.KVBlock, data: bytes = b"") -> Decoded:
    message = kvstore_pb2.PutBlocksRequest(bytes_in_data_plane=True)
    message.headers.extend(b.header for b in blocks)
    return Decoded(message, memoryview(data))


def test_a_plane_kvstore_indexes_headers_and_refuses_bytes():
    handlers = KVStoreHandlers(MemoryBlockStore(3 * WIRE_BLOCK_BYTES), KVStoreMetrics(), data_plane=True)
    reply = handlers.put_blocks([_index_only(wire_block(b"a"), wire_block(b"b"))], "grpc")
    assert (reply.num_stored, reply.num_bytes) == (2, 2 * WIRE_BLOCK_BYTES)  # counted at their real size
    assert handlers.store.stats().used_bytes == 2 * WIRE_BLOCK_BYTES
    with pytest.raises(InvalidArgument, match=r"^INVALID_ARGUMENT: put\[0\]\.data"):
        handlers.put_blocks([_index_only(wire_block(b"c"), data=b"xx")], "grpc")
    with pytest.raises(InvalidArgument, match=r"^INVALID_ARGUMENT: put\[0\]\.bytes_in_data_plane.*--backend mooncake"):
        handlers.put_blocks([Decoded(kvstore_pb2.PutBlocksRequest(), memoryview(b""))], "grpc")
    with pytest.raises(InvalidArgument, match=r"^INVALID_ARGUMENT: put:"):
        handlers.put(iter([kvstore_pb2.PutRequest(block=wire_block(b"c"))]), "grpc")
    with pytest.raises(InvalidArgument, match=r"^INVALID_ARGUMENT: headers_only"):
        handlers.get_blocks(kvstore_pb2.GetRequest(block_hashes=[h(b"a")]), "grpc")
    [answer] = handlers.get_blocks(kvstore_pb2.GetRequest(block_hashes=[h(b"a"), h(b"z")], headers_only=True), "grpc")
    assert list(answer.message.found) == [True, False] and answer.buffers == []
    assert answer.message.headers[0] == wire_block(b"a").header


def test_a_kvstore_without_a_plane_refuses_index_only_requests():
    handlers = KVStoreHandlers(MemoryBlockStore(1 << 20), KVStoreMetrics())
    with pytest.raises(InvalidArgument, match=r"^INVALID_ARGUMENT: put\[0\]\.bytes_in_data_plane.*no data plane"):
        handlers.put_blocks([_index_only(wire_block(b"a"))], "grpc")
    with pytest.raises(InvalidArgument, match=r"^INVALID_ARGUMENT: headers_only.*no data plane"):
        handlers.get_blocks(kvstore_pb2.GetRequest(block_hashes=[h(b"a")], headers_only=True), "grpc")


@pytest.mark.parametrize("argv, message", [
    (["--backend", "mooncake"], "--mooncake-master"),
    (["--mooncake-master", "127.0.0.1:1"], "--mooncake-master: only with --backend mooncake"),
    (["--mooncake-replicas", "2"], "only with --backend mooncake"),
    (["--backend", "mooncake", "--mooncake-master", "127.0.0.1:1", "--mooncake-replicas", "9"],
     "--mooncake-replicas"),
    (["--backend", "mooncake", "--mooncake-master", "127.0.0.1:1", "--ucx-port", "0"], "ucx_port"),
])
def test_pdserve_kvstore_refuses_mooncake_flags_that_disagree(argv, message, capsys):
    assert main(["--port", "0", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_metadata_server_defaults_to_the_masters_host():
    from pdserve.services.kvstore.main import add_arguments
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--backend", "mooncake", "--mooncake-master", "10.1.2.3:50100",
                                                 "--mooncake-replicas", "2"]))
    assert config.mooncake.metadata_server == "http://10.1.2.3:8080/metadata"
    assert config.mooncake.failover_s == mooncake_plane.DEFAULT_FAILOVER_S  # replicas 2: fail over


class _Registrations:
    """What ReadBuffers registers and unregisters with the (fake) transfer engine."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.calls = 0

    def register_buffer(self, address: int, size: int) -> int:
        self.registered[address] = size
        self.calls += 1
        return 0

    def unregister_buffer(self, address: int) -> int:
        del self.registered[address]
        return 0


def test_reads_land_in_a_kept_buffer_once_nothing_views_it():
    plane = _Registrations()
    buffers = ReadBuffers(lambda: plane, max_bytes=8 << 20)
    first, registered = buffers.take(3 << 20)
    assert registered and first.nbytes == 3 << 20 and plane.registered == {first.ctypes.data: 4 << 20}
    view = torch.frombuffer(memoryview(first)[:1024], dtype=torch.uint8)  # as a read's payload views it
    del first
    second, _ = buffers.take(1 << 20)  # the first is still viewed: another block
    assert second.ctypes.data not in {view.data_ptr()} and len(plane.registered) == 2
    address = view.data_ptr()
    del view, second
    third, registered = buffers.take(2 << 20)  # both free: the smallest that fits, registered already
    assert registered and third.ctypes.data in plane.registered and plane.calls == 2
    del third
    again, _ = buffers.take(3 << 20)
    assert again.ctypes.data == address and plane.calls == 2


def test_read_buffers_hold_at_most_their_bound_then_a_read_gets_its_own():
    plane = _Registrations()
    buffers = ReadBuffers(lambda: plane, max_bytes=4 << 20)
    small, _ = buffers.take(1 << 20)
    del small
    big, registered = buffers.take(3 << 20)  # 4 MiB: the free 1 MiB block is let go for it
    assert registered and buffers.held_bytes == 4 << 20 and list(plane.registered.values()) == [4 << 20]
    other, registered = buffers.take(1 << 20)  # no room while `big` is viewed: a buffer of its own
    assert not registered and other.nbytes == 1 << 20 and len(plane.registered) == 1
    del other
    buffers.close()  # `big` is still viewed: kept registered until the client closes
    assert len(plane.registered) == 1 and buffers.held_bytes == 0
    empty, registered = buffers.take(0)
    assert empty.nbytes == 0 and not registered


def test_transfers_are_waited_for_on_low_priority_threads_and_fail_as_the_plane_does():
    """Mooncake's client polls for a transfer's end without pause: it does so at nice 19,
    off the caller's thread (which sleeps), so the cores go to the threads moving bytes."""
    import os
    import threading
    from pdserve.services.kvstore.transports.mooncake.client import MooncakeTransport
    settings = MooncakeSettings("127.0.0.1:1", "http://127.0.0.1:2/metadata")
    transport = MooncakeTransport(None, settings, _Registrations())
    seen, caller_nice = [], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def transfer(*args):
        seen.append((threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return list(args)
    try:
        assert transport._transfer("get", transfer, 1, 2) == [1, 2]
        assert seen[0][0] != threading.get_native_id() and seen[0][1] == mooncake_plane.TRANSFER_WAIT_NICE
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller_nice

        def fails():
            raise RuntimeError("transfer engine said no")
        with pytest.raises(grpc.RpcError, match="Mooncake Store get failed: transfer engine said no"):
            transport._transfer("get", fails)
    finally:
        transport._waiters.shutdown()


def test_read_buffers_tell_a_range_inside_one_of_their_blocks():
    buffers = ReadBuffers(lambda: _Registrations(), max_bytes=4 << 20)
    view, _ = buffers.take(1 << 20)
    base = view.ctypes.data
    assert buffers.covers(base, 1 << 20) and buffers.covers(base + 100, 1000)
    assert not buffers.covers(base - 1, 10) and not buffers.covers(base, (1 << 20) + 1)


# ---- a real Mooncake Store ---------------------------------------------------------------

@pytest.fixture
def plane_kvstore(mooncake_cluster):
    """start(**config) -> (running kvstore on the session's Mooncake Store, a client over it)."""
    made = []

    def start(**overrides):
        running = serve(KVStoreConfig(**{"capacity_bytes": 1 << 20, "metrics_port": None, "backend": "mooncake",
                                         "mooncake": mooncake_cluster.settings, **overrides}))
        client = KVStoreClient(running.address, transport="mooncake", timeout_s=10)
        made.append((running, client))
        return running, client

    yield start
    for running, client in made:
        client.close()
        running.stop()


def test_the_bytes_live_in_mooncake_and_the_kvstore_holds_none(plane_kvstore, mooncake_cluster):
    running, client = plane_kvstore()
    p = payload(6, seed=1)
    assert put(client, p) == 6
    got = read(client, p)
    assert got is not None and torch.equal(as_tensor(got.blocks), p.blocks)
    stats = client.stats()
    assert (stats.num_blocks, stats.used_bytes) == (6, p.blocks.numel() * 4)
    # every block is an object of the plane, under its key; the kvstore's entries hold no bytes
    plane = mooncake_plane.connect(mooncake_cluster.settings)
    try:
        headers, _ = payload_to_put(p, LAYOUT, tail_key="")
        keys = [object_key(hash_key(hd.block_hash), hd.checksum) for hd in headers]
        assert plane.batch_is_exist(keys) == [1] * 6
    finally:
        plane.close()
    assert all(len(e.block.data) == 0 for e in running.store._entries.values())


def test_reads_reuse_their_buffers_and_bytes_read_can_be_written_again(plane_kvstore):
    _, client = plane_kvstore()
    first, second = payload(4, seed=11), payload(4, seed=12)
    assert put(client, first) == 4 and put(client, second) == 4
    got = read(client, first)
    reads = client._block_transport()._reads
    held = reads.held_bytes
    address = got.blocks.data_ptr()
    # blocks viewed where a read put them (a view of a kept, registered buffer) are written
    # again under other hashes: the buffer stays registered for the reads after
    again = [h(f"again-{i}".encode()) for i in range(4)]
    assert put(client, KVPayload(got.num_tokens, got.blocks, again)) == 4
    del got
    for p in (first, second, KVPayload(first.num_tokens, first.blocks, again), first):
        got = read(client, p)  # each read lands in the buffer the one before let go of
        assert got is not None and torch.equal(as_tensor(got.blocks), p.blocks)
        assert got.blocks.data_ptr() == address
        del got
    assert reads.held_bytes == held


def test_a_block_the_index_evicts_leaves_mooncake_too(plane_kvstore, mooncake_cluster):
    block_bytes = SHAPE[0] * 2 * SHAPE[2] * SHAPE[3] * SHAPE[4] * 4
    running, client = plane_kvstore(capacity_bytes=4 * block_bytes)
    first, second = payload(4, seed=2), payload(2, seed=3)
    put(client, first)
    put(client, second)  # evicts first's two least recent blocks from the index
    assert client.lookup(first.block_hashes) == 0 and client.lookup(first.block_hashes[2:]) == 2
    headers, _ = payload_to_put(first, LAYOUT, tail_key="")
    evicted = [object_key(hash_key(hd.block_hash), hd.checksum) for hd in headers[:2]]
    plane = mooncake_plane.connect(mooncake_cluster.settings)
    try:
        deadline = time.monotonic() + 5
        while plane.batch_is_exist(evicted) != [0, 0] and time.monotonic() < deadline:
            time.sleep(0.05)  # removed by the kvstore's remover thread, off its lock
        assert plane.batch_is_exist(evicted) == [0, 0]
    finally:
        plane.close()


def test_a_block_mooncake_lost_is_not_found_then_dropped_from_the_index(plane_kvstore, mooncake_cluster):
    running, client = plane_kvstore()
    p = payload(5, seed=4)
    put(client, p)
    headers, _ = payload_to_put(p, LAYOUT, tail_key="")
    plane = mooncake_plane.connect(mooncake_cluster.settings)
    try:
        assert plane.remove(object_key(hash_key(headers[3].block_hash), headers[3].checksum)) == 0
    finally:
        plane.close()
    got = read(client, p)  # blocks 0-2 read; 3 is recomputed by the reader, and 4 after it
    assert got is not None and got.num_blocks == 3 and torch.equal(as_tensor(got.blocks), p.blocks[:3])
    # the index learns it: the next prefill is told to write block 3 again, not that it is there.
    # Its reconciler thread may have found it first (every 2 s: a slow run gets there before
    # this line), so the count of blocks dropped is what tells, once either pass has run.
    running.store.reconcile()
    assert running.store.num_lost == 1
    assert client.lookup(p.block_hashes) == 3
    put(client, p)
    assert torch.equal(read(client, p).blocks, p.blocks)


def test_a_worker_on_mooncake_against_a_kvstore_without_a_plane_is_told_so():
    running = serve(KVStoreConfig(capacity_bytes=1 << 20, metrics_port=None))
    client = KVStoreClient(running.address, transport="mooncake")
    try:
        with pytest.raises(grpc.RpcError) as err:
            put(client, payload(1, seed=5))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--backend mooncake" in err.value.details()
    finally:
        client.close()
        running.stop()


def test_a_store_node_killed_loses_no_block_with_two_replicas(tmp_path):
    """kill -9 of one of two store nodes: every block is still read, whole and bit-exact
    (the reads that pick the dead node's replica wait until the master drops it)."""
    cluster = MooncakeCluster(tmp_path, replicas=2).start_all()
    running = serve(KVStoreConfig(capacity_bytes=1 << 20, metrics_port=None, backend="mooncake",
                                  mooncake=cluster.settings))
    client = KVStoreClient(running.address, transport="mooncake", timeout_s=30)
    try:
        written = [payload(4, seed=10 + i) for i in range(3)]
        for p in written:
            put(client, p)
        cluster.kill("store-0")
        for p in written:
            got = read(client, p)
            assert got is not None and got.num_blocks == 4 and torch.equal(as_tensor(got.blocks), p.blocks)
        later = payload(4, seed=20)  # written with one node left: it still succeeds
        put(client, later)
        assert torch.equal(read(client, later).blocks, later.blocks)
    finally:
        client.close()
        running.stop()
        cluster.stop()


def test_with_one_replica_a_killed_node_means_recompute_then_writes_go_on(tmp_path):
    """kill -9 of the only store node, then of the master: reads find nothing (the reader
    recomputes: never wrong bytes), errors are clear, and once both are back writes and
    reads work again."""
    cluster = MooncakeCluster(tmp_path, replicas=1).start_all()
    running = serve(KVStoreConfig(capacity_bytes=1 << 20, metrics_port=None, backend="mooncake",
                                  mooncake=cluster.settings))
    client = KVStoreClient(running.address, transport="mooncake", timeout_s=30)
    try:
        p = payload(3, seed=30)
        put(client, p)
        cluster.kill("store-0")
        assert read(client, p) is None
        cluster.kill("mooncake-master")
        with pytest.raises(grpc.RpcError) as err:  # the plane is gone: said so, as any kvstore failure
            put(client, payload(1, seed=31))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Mooncake" in err.value.details()
        cluster.start("mooncake-master")
        cluster.start("store-0")
        assert read(client, p) is None  # the restarted master knows none of the old objects
        again = payload(3, seed=32)
        deadline = time.monotonic() + 20
        while True:  # the clients find the new master by themselves
            try:
                put(client, again)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert torch.equal(read(client, again).blocks, again.blocks)
    finally:
        client.close()
        running.stop()
        cluster.stop()
