"""Hundreds of Generate streams open on one router, queued in admission or held on the
workers: its health still answers at once (Kubernetes probes it on the same port), and
every stream completes with its tokens once the workers go on."""
from __future__ import annotations

import threading
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine import SamplingParams
from pdserve.services.common.grpc_server import channel
from pdserve.services.router.client import RouterClient
from pdserve.services.router.config import SLOClass
from pdserve.services.router.state.discovery import DECODE
from tests.services.router.fakes import DEFAULT_MAX_TOKENS, expected_tokens, wait_until

NUM_STREAMS = 300  # past the 256 server threads the router had: the rest queued unseen in gRPC
HELD_PER_WORKER = 16  # the fake workers' own server threads


def test_health_answers_with_hundreds_of_streams_open_and_none_is_lost(make_cluster):
    # queued requests wait for a worker as long as the test holds them
    classes = {"interactive": SLOClass(ttft_ms=1000, itl_ms=100, max_queue_ms=120_000)}
    cluster = make_cluster(num_prefill=0, num_decode=2, slo_classes=classes)
    hold = threading.Event()
    for decode in cluster.decodes:
        decode.hold = hold
    prompt = list(range(5, 15))
    with RouterClient(cluster.router.address) as client:
        streams = [client.generate(prompt, SamplingParams(max_tokens=DEFAULT_MAX_TOKENS), timeout_s=120)
                   for _ in range(NUM_STREAMS)]
        try:
            wait_until(lambda: all(len(d.requests) >= HELD_PER_WORKER for d in cluster.decodes), "workers hold streams")
            # 128 on the workers (64 each, the router's bound), the rest in its admission queue
            queued = {"pool": DECODE, "slo_class": "interactive"}
            metrics = cluster.router.metrics.metrics
            wait_until(lambda: metrics.value("router_queued_requests", queued) >= NUM_STREAMS - 128,
                       "the rest queued in the router's admission (not unseen inside gRPC, short of threads)")
            with channel(cluster.router.address) as ch:
                started = time.monotonic()
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                assert status.status == health_pb2.HealthCheckResponse.SERVING
                assert time.monotonic() - started < 1
        finally:
            hold.set()
        outputs = [[t for msg in stream for t in msg.token_ids] for stream in streams]
    assert all(out == expected_tokens(len(prompt)) for out in outputs)

