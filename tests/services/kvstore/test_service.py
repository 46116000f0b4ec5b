"""The service as other tools see it: health, reflection, /metrics, and bad input refused
with the field named, over raw gRPC and raw UCX frames, the server serving on after."""
from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.services.common.grpc_server import channel
from pdserve.services.kvstore.transports.ucx import frames
from pdserve.services.kvstore.transports.ucx import runtime as ucx_runtime
from pdserve.services.kvstore.client import KVStoreClient
from pdserve.services.kvstore.server import KVStoreConfig, serve
from pdserve.services.kvstore.transports.ucx.runtime import ucxx
from pdserve.services.pb import kvstore_pb2 as pb
from pdserve.services.pb import kvstore_pb2_grpc
from tests.services.kvstore.conftest import WIRE_BLOCK_BYTES, h, redis_server, wire_block


@pytest.fixture
def running(start_kvstore):
    return start_kvstore(capacity_bytes=2 * WIRE_BLOCK_BYTES)


@pytest.fixture
def stub(running):
    with channel(running.address) as ch:
        yield kvstore_pb2_grpc.KVStoreStub(ch)


def test_health_reports_serving(running):
    with channel(running.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pdserve.v1.KVStore"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_kvstore(running):
    with channel(running.address) as ch:
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = [s.name for s in next(replies).list_services_response.service]
    assert "pdserve.v1.KVStore" in names and "grpc.health.v1.Health" in names


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(pdserve_kvstore_[a-z_]+(?:\{[^}]*\})?) (\S+)", line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def test_metrics_follow_the_traffic(start_kvstore, clock):
    running = start_kvstore(capacity_bytes=2 * WIRE_BLOCK_BYTES, metrics_port=0, sweep_interval_ms=10)
    client = KVStoreClient(running.address)
    try:
        before = scrape(running.metrics_port)
        assert before["pdserve_kvstore_capacity_bytes"] == 2 * WIRE_BLOCK_BYTES
        assert before["pdserve_kvstore_hits_total"] == 0
        lease = client.create_lease(1_000)
        client.put([wire_block(b"a"), wire_block(b"b")], lease_id=lease)
        client.get([h(b"a"), h(b"zz")])
        with pytest.raises(grpc.RpcError):
            client.put([wire_block(b"c")])            # full: both blocks pinned
        client.release_lease(lease)
        client.put([wire_block(b"c")])                # evicts b
        client.create_lease(1_000)
        clock.advance(2)                              # the sweeper ends that lease
        _wait_for(lambda: running.metrics.metrics.value("kvstore_leases_expired_total") == 1)
        after = scrape(running.metrics_port)
    finally:
        client.close()
    assert after["pdserve_kvstore_hits_total"] == 1
    assert after["pdserve_kvstore_misses_total"] == 1
    assert after["pdserve_kvstore_evictions_total"] == 1
    assert after['pdserve_kvstore_puts_rejected_total{reason="full"}'] == 1
    assert after["pdserve_kvstore_leases_created_total"] == 2
    assert after["pdserve_kvstore_leases_released_total"] == 1
    assert after["pdserve_kvstore_leases_expired_total"] == 1
    assert after["pdserve_kvstore_active_leases"] == 0
    assert after['pdserve_kvstore_put_bytes_total{transport="grpc"}'] == 3 * WIRE_BLOCK_BYTES
    assert after['pdserve_kvstore_get_bytes_total{transport="grpc"}'] == WIRE_BLOCK_BYTES
    assert after['pdserve_kvstore_get_seconds_count{transport="grpc"}'] == 1
    assert after['pdserve_kvstore_put_seconds_count{transport="grpc"}'] == 2
    assert (after["pdserve_kvstore_used_bytes"], after["pdserve_kvstore_blocks"]) == (2 * WIRE_BLOCK_BYTES, 2)


def test_stop_frees_the_metrics_port(start_kvstore):
    running = start_kvstore(metrics_port=0)
    assert "pdserve_kvstore_hits_total" in scrape(running.metrics_port)
    running.stop()
    with pytest.raises(OSError):  # connection refused: nothing listens there any more
        scrape(running.metrics_port)


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    """Polls for something a background thread does; fails (never passes) on timeout."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _blocks(*blocks, lease_id=""):
    return iter([pb.PutRequest(lease_id=lease_id, block=b) for b in blocks])


def _with(header_change=None, data=None):
    block = wire_block(b"h")
    if header_change:
        header_change(block.header)
    if data is not None:
        block.data = data
    return block


BAD_PUTS = [
    ("put[0].block.header.block_hash", _with(lambda h: setattr(h, "tail_key", "t"))),
    ("put[0].block.header.block_hash", _with(lambda h: setattr(h, "block_hash", b""))),
    ("put[0].block.header.block_hash", _with(lambda h: setattr(h, "block_hash", b"x" * 65))),
    ("put[0].block.header.dtype", _with(lambda h: setattr(h, "dtype", "int4"))),
    ("put[0].block.header.shape", _with(lambda h: h.shape.__setitem__(1, 0))),
    ("put[0].block.header.layer_end", _with(lambda h: setattr(h, "layer_end", 3))),
    ("put[0].block.header.layer_end", _with(lambda h: setattr(h, "layer_start", 2))),
    ("put[0].block.header.num_tokens", _with(lambda h: setattr(h, "num_tokens", 0))),
    ("put[0].block.data", _with(data=b"\x00" * (WIRE_BLOCK_BYTES + 2))),
]


@pytest.mark.parametrize("field,bad", BAD_PUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PUTS)])
def test_a_bad_block_names_its_field(stub, field, bad):
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(_blocks(bad), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":")
    assert stub.Put(_blocks(wire_block(b"good")), timeout=5).num_stored == 1


BAD_CALLS = [
    ("Put", lambda: _blocks(wire_block(b"a"), lease_id="x"), grpc.StatusCode.FAILED_PRECONDITION, "lease_id"),
    ("Put", lambda: iter([pb.PutRequest(lease_id="x", block=wire_block(b"a")),
                          pb.PutRequest(lease_id="y", block=wire_block(b"b"))]),
     grpc.StatusCode.INVALID_ARGUMENT, "put[1].lease_id"),
    ("Put", lambda: iter([pb.PutRequest()]), grpc.StatusCode.INVALID_ARGUMENT, "put[0].block"),
    ("Get", lambda: pb.GetRequest(block_hashes=[h(b"ok"), b""]), grpc.StatusCode.INVALID_ARGUMENT, "block_hashes[1]"),
    ("Get", lambda: pb.GetRequest(tail_keys=[""]), grpc.StatusCode.INVALID_ARGUMENT, "tail_keys[0]"),
    ("Lookup", lambda: pb.LookupRequest(block_hashes=[b"y" * 100]), grpc.StatusCode.INVALID_ARGUMENT,
     "block_hashes[0]"),
    ("CreateLease", lambda: pb.CreateLeaseRequest(ttl_ms=10**9), grpc.StatusCode.INVALID_ARGUMENT, "ttl_ms"),
    ("ReleaseLease", lambda: pb.ReleaseLeaseRequest(), grpc.StatusCode.INVALID_ARGUMENT, "lease_id"),
]


@pytest.mark.parametrize("method,request_fn,code,field", BAD_CALLS,
                         ids=[f"{m}-{f}" for m, _, _, f in BAD_CALLS])
def test_a_bad_request_names_its_field_and_the_server_serves_on(stub, method, request_fn, code, field):
    call = getattr(stub, method)
    with pytest.raises(grpc.RpcError) as err:
        reply = call(request_fn(), timeout=5)
        list(reply) if method == "Get" else reply  # a stream fails when read
    assert err.value.code() == code
    assert err.value.details().startswith(field + ":")
    assert stub.Put(_blocks(wire_block(b"good")), timeout=5).num_stored == 1
    assert [b.found for b in stub.Get(pb.GetRequest(block_hashes=[h(b"good")]), timeout=5)] == [True]


def test_a_lease_with_ttl_zero_gets_the_default(stub):
    lease = stub.CreateLease(pb.CreateLeaseRequest(), timeout=5)
    assert lease.ttl_ms == 30_000 and len(lease.lease_id) == 32


async def _raw_ucx(port: int, sends: list[bytes], num_replies: int) -> list[bytes]:
    endpoint = await ucxx.create_endpoint("127.0.0.1", port)
    try:
        await endpoint.send(frames.hello_frame(None))  # every connection begins with it
        assert frames.kind_of(await endpoint.recv_obj()) == frames.HELLO_OK
        for data in sends:
            await endpoint.send_obj(data)
        return [bytes(await endpoint.recv_obj()) for _ in range(num_replies)]
    finally:
        endpoint.abort()


def test_bad_ucx_frames_get_error_frames_and_the_connection_serves_on(running):
    port = int(running.ucx_address.rsplit(":", 1)[1])
    good_get = frames.frame(frames.GET, pb.GetRequest(tail_keys=["t"]))
    replies = ucx_runtime.run(_raw_ucx(port, [
        b"Zhello",                                            # no such request kind
        frames.GET + b"\xff\xff",                             # not a GetRequest
        frames.PUT + b"\xff", frames.PUT_END,                 # a Put whose frame does not parse
        good_get,
    ], num_replies=5), timeout=30)
    errors = [frames.parse_error(r) for r in replies[:3]]
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert [e.details().split(":")[0] for e in errors] == ["frame"] * 3
    assert frames.kind_of(replies[3]) == frames.BLOCK
    assert frames.parse(replies[3], pb.KVBlock).found is False
    assert frames.kind_of(replies[4]) == frames.GET_END


@pytest.mark.parametrize("transport", ["grpc", "ucx"])
def test_an_unexpected_failure_is_unknown_and_the_next_call_works(running, transport, monkeypatch):
    real_get = running.store.get
    calls = []

    def failing_once(keys):
        calls.append(keys)
        if len(calls) == 1:
            raise RuntimeError("disk on fire")
        return real_get(keys)

    monkeypatch.setattr(running.store, "get", failing_once)
    client = KVStoreClient(running.address, transport=transport)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.get([h(b"a")])
        assert err.value.code() == grpc.StatusCode.UNKNOWN
        assert [b.found for b in client.get([h(b"a")])] == [False]
    finally:
        client.close()


def test_a_redis_outage_is_unavailable_and_metrics_still_answer(start_kvstore):
    with redis_server() as (url, redis_proc):
        running = start_kvstore(backend=url, metrics_port=0)
        client = KVStoreClient(running.address)
        try:
            assert client.put([wire_block(b"a")]) == 1
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
            for call in (lambda: client.put([wire_block(b"b")]), lambda: client.get([h(b"a")]),
                         lambda: client.lookup([h(b"a")]), client.stats):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "redis" in err.value.details()
            samples = scrape(running.metrics_port)
            assert "pdserve_kvstore_hits_total" in samples and "pdserve_kvstore_used_bytes" not in samples
        finally:
            client.close()


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_short_lease_expires_on_the_real_clock(backend, request):
    url = "memory" if backend == "memory" else request.getfixturevalue("redis_url").rsplit("/", 1)[0] + "/3"
    if backend == "redis":
        redis.Redis.from_url(url).flushdb()
    running = serve(KVStoreConfig(backend=url, metrics_port=None, sweep_interval_ms=10))
    client = KVStoreClient(running.address)
    try:
        lease = client.create_lease(50)
        client.put([wire_block(b"a")], lease_id=lease)
        _wait_for(lambda: client.stats().num_active_leases == 0)
        assert client.stats().num_pinned_blocks == 0
        assert client.release_lease(lease) is False
        assert running.metrics.metrics.value("kvstore_leases_expired_total") == 1
    finally:
        client.close()
        running.stop()
