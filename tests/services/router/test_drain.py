"""A router told to stop drains: new requests are refused at once (gRPC UNAVAILABLE, health
NOT_SERVING, HTTP 503), streams in flight finish within the drain timeout, and what still
runs then ends with an error that names the drain, never a silent end of stream."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine import SamplingParams
from pdserve.services.common.grpc_server import channel
from pdserve.services.router.client import RouterClient
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.drain import SHUTTING_DOWN, Drain
from pdserve.services.router.errors import RouterError
from tests.services.router.fakes import wait_until

LONG = "a prompt long enough to go through the prefill pool, " * 3


def _stop_in_background(cluster, grace_s: float) -> threading.Thread:
    thread = threading.Thread(target=cluster.router.stop, kwargs={"grace_s": grace_s})
    thread.start()
    return thread


def _health(address: str) -> int:
    with channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def _finish(cluster, stopper: threading.Thread) -> None:
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    cluster.router = None  # stopped: the fixture must not stop it again


def test_streams_in_flight_finish_and_new_requests_are_refused(make_cluster):
    cluster = make_cluster(num_prefill=1, num_decode=1)
    decode = cluster.decodes[0]
    decode.hold, decode.hold_after = threading.Event(), 2
    address = cluster.router.address
    with RouterClient(address) as client:
        stream = client.generate(LONG, SamplingParams(max_tokens=6, temperature=0.0))
        first = [next(stream), next(stream)]  # the prefill's token, then the decode's first
        wait_until(decode.holding.is_set, "the decode stream to be held mid-way")
        stopper = _stop_in_background(cluster, grace_s=20.0)
        wait_until(lambda: _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as refused:
            client.generate_text(LONG, SamplingParams(max_tokens=2))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        decode.hold.set()  # the stream in flight goes on, within the drain timeout
        rest = list(stream)
    _finish(cluster, stopper)
    assert rest[-1].finish_reason == "length"
    assert sum(len(m.token_ids) for m in first + rest) == 6


def test_what_outlives_the_drain_timeout_ends_with_an_error_naming_it(make_cluster):
    cluster = make_cluster(num_prefill=1, num_decode=1)
    decode = cluster.decodes[0]
    decode.hold, decode.hold_after = threading.Event(), 1  # never set: the stream hangs
    with RouterClient(cluster.router.address) as client:
        stream = client.generate(LONG, SamplingParams(max_tokens=6, temperature=0.0))
        next(stream)
        wait_until(decode.holding.is_set, "the decode stream to be held")
        t = time.monotonic()
        stopper = _stop_in_background(cluster, grace_s=0.5)
        with pytest.raises(grpc.RpcError) as cut:
            list(stream)
        took = time.monotonic() - t
    _finish(cluster, stopper)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shut down before this request finished" in cut.value.details()
    assert "0.5 s" in cut.value.details()
    assert 0.4 < took < 5
    wait_until(decode.saw_cancel.is_set, "the worker's call to be cancelled (it frees the request)")


def _until_cancelled(cancel):
    """A request's messages as the flow streams them: until its request is cancelled."""
    yield "first"
    while not cancel.cancelled:
        time.sleep(0.005)


def test_draining_front_refuses_then_cuts_with_the_timeout_in_the_message():
    drain = Drain()
    cancel = Cancellation()
    running = drain.run(cancel, _until_cancelled(cancel))
    assert next(running) == "first"
    assert drain.num_active == 1 and not drain.wait_idle(0.01)
    drain.start()
    with pytest.raises(RouterError, match="shutting down") as refused:
        late = Cancellation()
        next(drain.run(late, _until_cancelled(late)))
    assert refused.value.message == SHUTTING_DOWN
    assert drain.cut(after_s=7) == 1
    with pytest.raises(RouterError, match="drain timeout of 7 s") as cut:
        next(running)
    assert cut.value.code == grpc.StatusCode.UNAVAILABLE
    assert drain.num_active == 0 and drain.wait_idle(0)
