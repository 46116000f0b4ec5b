"""A worker beside a Mooncake store node moves its blocks through that node by shared memory
(services/kvstore/transports/mooncake/local.py: Mooncake's dummy client), never over TCP; one with no
node on its host (or told "off") over TCP as before; one whose node dies goes on over TCP
and back through the node once it serves again. Real processes: a master and store nodes
on loopback (cli/bench/mooncake_cluster.py)."""
from __future__ import annotations

import argparse
import dataclasses
import time

import pytest
import torch

from pdserve.cli.bench.local_platform import free_port_range
from pdserve.cli.bench.mooncake_cluster import MooncakeCluster
from pdserve.engine.kv_transfer import KVPayload, as_tensor
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.main import add_arguments, config_from_args
from pdserve.services.kvstore.transports.mooncake.buffers import ShmBuffers
from pdserve.services.kvstore.transports.mooncake.local import local_store_nodes
from pdserve.services.kvstore.transports.mooncake.plane import MooncakeSettings
from pdserve.services.kvstore.server import KVStoreConfig, serve
from tests.services.kvstore.test_mooncake import payload, put, read

ELSEWHERE = "192.0.2.1"  # TEST-NET-1: never an address of this machine


def _nbytes(p: KVPayload) -> int:
    return p.blocks.numel() * p.blocks.element_size()


class _NoTcp:
    """Stands in for the TCP client: any use of it is recorded (and fails the transfer)."""

    def __init__(self):
        self.used: list[str] = []

    def __getattr__(self, name):
        self.used.append(name)
        raise AssertionError(f"the TCP client's {name} was used")


@pytest.fixture
def kvstore_on(mooncake_cluster):
    """kvstore_on(settings=None, **client) -> a client of a kvstore on the session's Mooncake
    Store (its settings name its store node, on 127.0.0.1, as `pdserve up` does)."""
    made = []

    def start(settings: MooncakeSettings | None = None, **client_args) -> KVStoreClient:
        running = serve(KVStoreConfig(capacity_bytes=1 << 20, metrics_port=None, backend="mooncake",
                                      mooncake=settings or mooncake_cluster.settings))
        client = KVStoreClient(running.address, transport="mooncake", timeout_s=10, **client_args)
        made.append((running, client))
        return client

    yield start
    for running, client in made:
        client.close()
        running.stop()


def test_beside_the_store_node_blocks_move_through_it_and_no_tcp_client_is_made(kvstore_on, mooncake_cluster):
    client = kvstore_on(mooncake_local_node="auto")
    p = payload(6, seed=101)
    assert put(client, p) == 6
    transport = client._block_transport()
    assert transport.local is not None and transport.local.node == mooncake_cluster.settings.store_nodes[0]
    assert transport._plane is None  # the transfer engine's client was never connected
    got = read(client, p)
    assert got is not None and torch.equal(as_tensor(got.blocks), p.blocks)
    # the read landed in shared memory the node maps
    assert isinstance(transport._reads, ShmBuffers) and transport._reads.covers(got.blocks.data_ptr(), _nbytes(p))
    assert transport._plane is None


def test_an_export_into_the_transports_memory_is_sent_from_where_it_lies(kvstore_on):
    client = kvstore_on(mooncake_local_node="auto")
    p = payload(8, seed=102)
    assert client.export_buffer(_nbytes(p)) is None  # not connected yet: the engine allocates
    put(client, payload(1, seed=103))  # the first put connects, as a worker's does
    buffer = client.export_buffer(_nbytes(p))
    assert buffer is not None and buffer.nbytes == _nbytes(p)
    transport = client._block_transport()
    transport._plane = _NoTcp()
    exported = torch.from_numpy(buffer).view(p.blocks.dtype).view(p.blocks.shape)
    exported.copy_(p.blocks)  # what the engine's export writes
    held = transport._reads.held_bytes
    assert put(client, KVPayload(p.num_tokens, exported, p.block_hashes)) == 8
    assert transport._reads.held_bytes == held  # no staging copy: sent from the export's memory
    got = read(client, p)
    assert torch.equal(as_tensor(got.blocks), p.blocks) and transport._plane.used == []
    transport._plane = None
    # a worker elsewhere (over TCP) reads the same bytes
    remote = KVStoreClient(client.address, transport="mooncake", timeout_s=10, mooncake_local_node="off")
    try:
        assert torch.equal(read(remote, p).blocks, p.blocks)
        assert remote._block_transport().local is None and remote.export_buffer(_nbytes(p)) is None
    finally:
        remote.close()


def test_blocks_in_other_memory_are_copied_into_the_shared_memory_then_sent(kvstore_on):
    client = kvstore_on(mooncake_local_node="auto")
    put(client, payload(1, seed=104))
    transport = client._block_transport()
    transport._plane = _NoTcp()
    p = payload(5, seed=105)  # heap memory, as without an export allocator
    assert put(client, p) == 5
    assert torch.equal(read(client, p).blocks, p.blocks) and transport._plane.used == []
    transport._plane = None


@pytest.mark.parametrize("store_nodes", [(), (f"{ELSEWHERE}:50103",)], ids=["none-named", "on-another-host"])
def test_auto_without_a_store_node_on_this_host_moves_blocks_over_tcp(kvstore_on, mooncake_cluster, store_nodes):
    client = kvstore_on(dataclasses.replace(mooncake_cluster.settings, store_nodes=store_nodes),
                        mooncake_local_node="auto")
    p = payload(4, seed=106)
    assert put(client, p) == 4 and torch.equal(read(client, p).blocks, p.blocks)
    transport = client._block_transport()
    assert transport.local is None and transport._plane is not None
    assert client.export_buffer(_nbytes(p)) is None


def test_off_moves_blocks_over_tcp_though_a_node_is_beside_it(kvstore_on):
    client = kvstore_on(mooncake_local_node="off")
    p = payload(3, seed=107)
    assert put(client, p) == 3 and torch.equal(read(client, p).blocks, p.blocks)
    assert client._block_transport().local is None


def test_a_named_node_that_is_not_running_means_tcp(kvstore_on):
    client = kvstore_on(mooncake_local_node=f"127.0.0.1:{free_port_range(1)}")
    p = payload(3, seed=108)
    assert put(client, p) == 3 and torch.equal(read(client, p).blocks, p.blocks)
    assert client._block_transport().local is None


def test_which_store_nodes_are_on_this_host():
    settings = MooncakeSettings("127.0.0.1:1", "http://127.0.0.1:2/metadata",
                                store_nodes=("127.0.0.1:3", f"{ELSEWHERE}:4", "localhost:5"))
    assert local_store_nodes(settings, "127.0.0.1") == ["127.0.0.1:3", "localhost:5"]
    # a kvstore on another host names its own loopback: not this host's
    assert local_store_nodes(settings, ELSEWHERE) == []


def test_bad_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="mooncake_local_node"):
        KVStoreClient("127.0.0.1:1", transport="mooncake", mooncake_local_node="beside-me")
    with pytest.raises(ValueError, match="mooncake_store_node"):
        MooncakeSettings("127.0.0.1:1", "http://127.0.0.1:2/metadata", store_nodes=("no-port",))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--mooncake-store-node: only with --backend mooncake"):
        config_from_args(parser.parse_args(["--mooncake-store-node", "127.0.0.1:3"]))
    with pytest.raises(ValueError, match="--mooncake-store-node: 'no-port'"):
        config_from_args(parser.parse_args(["--backend", "mooncake", "--mooncake-master", "127.0.0.1:1",
                                            "--mooncake-store-node", "no-port"]))


def test_worker_flag_takes_auto_off_or_an_address_and_names_itself_when_bad():
    from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, 0, "prefill")
    base = ["--model", "m"]
    assert worker_config_from_args(parser.parse_args(base)).mooncake_local_node == "auto"
    for value in ("off", "127.0.0.1:50103"):
        args = parser.parse_args([*base, "--mooncake-local-node", value])
        assert worker_config_from_args(args).mooncake_local_node == value
    with pytest.raises(ValueError, match="--mooncake-local-node"):
        worker_config_from_args(parser.parse_args([*base, "--mooncake-local-node", "nearby"]))


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_the_local_node_killed_means_tcp_then_through_it_again_once_it_serves(tmp_path):
    """kill -9 of the node the worker is attached to (two replicas), three times in a row:
    reads and writes go on over TCP, bit-exact; once the node serves again, through it
    (a restarted node knows none of the worker's buffers: they are registered again)."""
    cluster = MooncakeCluster(tmp_path, replicas=2).start_all()
    running = serve(KVStoreConfig(capacity_bytes=1 << 20, metrics_port=None, backend="mooncake",
                                  mooncake=cluster.settings))
    client = KVStoreClient(running.address, transport="mooncake", timeout_s=30, mooncake_local_node="auto")
    try:
        for cycle in range(3):
            before = payload(4, seed=110 + 10 * cycle)
            put(client, before)
            local = client._block_transport().local
            assert local is not None and local.node == cluster.settings.store_nodes[0]
            cluster.kill("store-0")
            got = read(client, before)
            assert got is not None and torch.equal(as_tensor(got.blocks), before.blocks)
            assert not local.up and local.num_gone == cycle + 1
            during = payload(4, seed=111 + 10 * cycle)
            put(client, during)
            assert torch.equal(read(client, during).blocks, during.blocks)
            cluster.start("store-0")
            _wait(lambda: local.up, 30, "the restarted local node was not found serving")
            transport = client._block_transport()
            plane, transport._plane = transport._plane, _NoTcp()
            moved = local.num_transfers
            try:
                after = payload(4, seed=112 + 10 * cycle)
                put(client, after)
                assert torch.equal(read(client, after).blocks, after.blocks) and transport._plane.used == []
            finally:
                transport._plane = plane
            assert local.num_gone == cycle + 1 and local.num_transfers == moved + 2  # the put and the get
    finally:
        client.close()
        running.stop()
        cluster.stop()


class _DummyClient:
    """A dummy client's memory calls: shared memory stands in as ctypes arrays; the node
    accepts registrations while `node_up`."""

    def __init__(self):
        self.node_up, self.memory, self.registered = True, {}, []

    def alloc_from_mem_pool(self, size: int) -> int:
        import ctypes
        block = (ctypes.c_uint8 * size)()
        self.memory[ctypes.addressof(block)] = block
        return ctypes.addressof(block)

    def register_buffer(self, address: int, size: int) -> int:
        if not self.node_up:
            return -1
        self.registered.append(address)
        return 0

    def unregister_buffer(self, address: int) -> int:
        raise AssertionError("shared memory is never let go")


def test_shared_memory_blocks_are_kept_the_bound_holds_and_those_made_while_the_node_was_away_join_later():
    client = _DummyClient()
    buffers = ShmBuffers(client, max_bytes=8 << 20)
    small, in_pool = buffers.take(1 << 20)
    assert in_pool and client.registered == [small.ctypes.data]
    del small
    big, in_pool = buffers.take(2 << 20)  # the free 1 MiB block is kept (never let go): 3 MiB held
    assert in_pool and buffers.held_bytes == 3 << 20 and len(client.registered) == 2
    other, in_pool = buffers.take(8 << 20)  # 11 MiB would pass the bound: memory of its own
    assert not in_pool and buffers.held_bytes == 3 << 20 and len(client.memory) == 2
    del big, other
    client.node_up = False
    away, in_pool = buffers.take(3 << 20)  # a 4 MiB block made, the node cannot map it: not used yet
    assert not in_pool and len(client.memory) == 3 and len(client.registered) == 2
    del away
    client.node_up = True
    buffers.register_pending()  # the node back: the block made meanwhile is used
    again, in_pool = buffers.take(3 << 20)
    assert in_pool and again.ctypes.data == client.registered[-1] and len(client.memory) == 3
    assert buffers.held_bytes == 7 << 20


def test_a_fresh_client_replaces_the_old_ones_memory_which_lives_while_viewed():
    """The node restarted: ShmBuffers.switch hands out the fresh client's memory only; the
    old client's block still viewed stays readable, and the old client is closed once
    nothing views its memory."""
    old, fresh = _DummyClient(), _DummyClient()
    closed = []
    old.close = lambda: closed.append("old")
    buffers = ShmBuffers(old, max_bytes=8 << 20)
    held, _ = buffers.take(1 << 20)
    held[:4] = [1, 2, 3, 4]
    buffers.switch(fresh)
    assert closed == []  # a view of its memory lives
    new, in_pool = buffers.take(1 << 20)
    assert in_pool and new.ctypes.data in fresh.memory and new.ctypes.data not in old.memory
    assert list(held[:4]) == [1, 2, 3, 4]
    del held
    buffers.take(1 << 10)  # any later call notices the view is gone
    assert closed == ["old"]
