"""KVStoreClient end to end against a real server on loopback, over each transport:
the same calls, answers and errors whichever carries the blocks (with "mooncake", the
server's backend is a real Mooncake Store and the bytes never reach the kvstore)."""
from __future__ import annotations

import logging
import threading

import grpc
import pytest
import torch

from pdserve.services.worker.kv_wire import block_from_proto, block_to_proto
from pdserve.services.kvstore.client import KVStoreClient, KVStoreFullError
from tests.services.kvstore.conftest import WIRE_BLOCK_BYTES, free_port, h, wire_block

TRANSPORTS = ["grpc", "tcp", "ucx", "mooncake"]


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


@pytest.fixture
def connect(transport):
    """connect(running) -> a client of that server over the parametrized transport."""
    clients = []

    def make(running, **kwargs):
        clients.append(KVStoreClient(running.address, transport=transport, **kwargs))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def test_worker_blocks_round_trip_bit_exact(start_kvstore, connect):
    client = connect(start_kvstore())
    torch.manual_seed(0)
    full = torch.randn(3, 2, 16, 2, 8, dtype=torch.bfloat16)
    tail = torch.randn(3, 2, 16, 2, 8, dtype=torch.float32)
    lease = client.create_lease(10_000, req_id="req-1")
    assert client.put([block_to_proto(full, 16, block_hash=b"\x01" * 32),
                       block_to_proto(tail, 5, tail_key="req-1/tail")], lease_id=lease) == 2
    assert client.lookup([b"\x01" * 32, b"\x02" * 32]) == 1
    got = client.get([b"\x01" * 32, b"\x02" * 32], ["req-1/tail", "other/tail"])
    assert [b.found for b in got] == [True, False, True, False]
    assert torch.equal(block_from_proto(got[0]), full) and torch.equal(block_from_proto(got[2]), tail)
    assert got[2].header.num_tokens == 5
    assert (got[1].header.block_hash, got[3].header.tail_key) == (b"\x02" * 32, "other/tail")
    assert client.release_lease(lease) is True
    assert client.release_lease(lease) is False
    stats = client.stats()
    assert (stats.num_blocks, stats.num_active_leases, stats.num_hits, stats.num_misses) == (1, 0, 2, 2)


def test_a_put_that_does_not_fit_raises_full_and_stores_nothing(start_kvstore, connect):
    client = connect(start_kvstore(capacity_bytes=2 * WIRE_BLOCK_BYTES))
    lease = client.create_lease(10_000)
    client.put([wire_block(b"a"), wire_block(b"b")], lease_id=lease)
    with pytest.raises(KVStoreFullError) as err:
        client.put([wire_block(b"c")])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(err.value, grpc.RpcError)  # workers catch RpcError for any store failure
    assert client.stats().num_blocks == 2
    client.release_lease(lease)
    assert client.put([wire_block(b"c")]) == 1


def test_a_put_under_an_unknown_lease_is_failed_precondition(start_kvstore, connect):
    client = connect(start_kvstore())
    with pytest.raises(grpc.RpcError) as err:
        client.put([wire_block(b"a")], lease_id="no-such-lease")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lease_id" in err.value.details()
    assert client.put([wire_block(b"a")]) == 1


def test_a_bad_block_is_invalid_argument_naming_the_field_then_serving_goes_on(start_kvstore, connect):
    client = connect(start_kvstore())
    bad = wire_block(b"b")
    bad.data = bad.data[:-1]
    with pytest.raises(grpc.RpcError) as err:
        client.put([wire_block(b"a"), bad])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("put[1].block.data:")
    assert client.stats().num_blocks == 0        # the good block of that put was not kept either
    assert client.put([wire_block(b"a")]) == 1
    assert client.get([h(b"a")])[0].found


def test_large_blocks_cross_both_transports(start_kvstore, connect):
    client = connect(start_kvstore(capacity_bytes=64 << 20))
    big = torch.arange(4 << 20, dtype=torch.float32).reshape(4, 2, 16, 32, 1024)  # 16 MiB
    client.put([block_to_proto(big, 16, block_hash=h(b"big"))])
    assert torch.equal(block_from_proto(client.get([h(b"big")])[0]), big)


def test_one_client_serves_many_threads(start_kvstore, connect):
    client = connect(start_kvstore())
    errors = []

    def work(i: int) -> None:
        try:
            for j in range(10):
                name = h(f"{i}-{j}".encode())
                assert client.put([wire_block(name, fill=i)]) == 1
                got = client.get([name])[0]
                assert got.found and got.data == bytes([i]) * WIRE_BLOCK_BYTES
        except Exception as e:  # collected: an assert in a thread would not fail the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert client.stats().num_blocks == 80


def test_ucx_with_an_explicit_address(start_kvstore):
    running = start_kvstore()
    client = KVStoreClient(running.address, transport="ucx", ucx_address=running.ucx_address)
    try:
        assert client.put([wire_block(b"a")]) == 1
        assert client.get([h(b"a")])[0].found
    finally:
        client.close()


def test_ucx_against_a_server_without_ucx_is_unavailable(start_kvstore):
    running = start_kvstore(ucx_port=None)
    client = KVStoreClient(running.address, transport="ucx")
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.put([wire_block(b"a")])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "--ucx-port" in err.value.details()
        assert client.lookup([h(b"a")]) == 0         # the gRPC calls still work
    finally:
        client.close()


def test_client_arguments_are_checked():
    with pytest.raises(ValueError, match="transport"):
        KVStoreClient("127.0.0.1:1", transport="rdma")
    with pytest.raises(ValueError, match="ucx_address"):
        KVStoreClient("127.0.0.1:1", transport="ucx", ucx_address="no-port")


def test_release_lease_quietly_logs_what_it_cannot_release(start_kvstore, caplog):
    running = start_kvstore()
    client = KVStoreClient(running.address, timeout_s=10)  # leases go over gRPC whatever the transport
    try:
        lease = client.create_lease(10_000)
        assert client.release_lease_quietly(lease) is True
        assert client.release_lease_quietly(lease) is False
        running.stop()
        with caplog.at_level(logging.WARNING, logger="pdserve.services.kvstore.client"):
            assert client.release_lease_quietly("") is False  # no lease: no call, nothing to say
            assert [r for r in caplog.records if r.name == "pdserve.services.kvstore.client"] == []
            assert client.release_lease_quietly("gone") is False  # the store is down: logged, not raised
        assert "lease gone" in caplog.text and "UNAVAILABLE" in caplog.text
        assert "expires by itself" in caplog.text
    finally:
        client.close()


def test_a_stopped_server_is_unavailable_over_either_transport(start_kvstore, connect):
    running = start_kvstore()
    client = connect(running, timeout_s=10)
    assert client.put([wire_block(b"a")]) == 1
    running.stop()
    with pytest.raises(grpc.RpcError) as err:
        client.put([wire_block(b"b")])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_ucx_to_a_port_nobody_listens_on_is_unavailable():
    client = KVStoreClient("127.0.0.1:1", transport="ucx", ucx_address=f"127.0.0.1:{free_port()}", timeout_s=10)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.get([h(b"a")])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()


def test_blocks_put_many_per_message_are_read_one_per_message(start_kvstore, connect):
    client = connect(start_kvstore())
    blocks = [wire_block(b"a", fill=3), wire_block(b"b", fill=4)]
    assert client.put_blocks([b.header for b in blocks], b"".join(b.data for b in blocks)) == 2
    assert [g.data for g in client.get([h(b"a"), h(b"b")])] == [b.data for b in blocks]
