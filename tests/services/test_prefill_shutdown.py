"""A prefill worker that shuts down under live requests drains before it disconnects from
the kvstore: the calls its server cut end in their handlers first (their leases released),
then the KV writes end, then the connection closes. No lease is left to expire."""
from __future__ import annotations

import logging
import threading
import time

import grpc

from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import common_pb2, prefill_pb2, prefill_pb2_grpc
from tests.services.cluster import start_cluster


def test_shutdown_under_live_prefills_leaves_no_lease_and_no_traceback(tiny_llama_dir, tiny, caplog):
    cluster = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=0, drain_timeout_s=0.0)
    prefill = cluster.prefills[0]
    errors: list = []
    try:
        # the engine is busy for a moment: the calls are admitted, hold a lease, and wait
        busy = prefill.loop.call(lambda engine: time.sleep(1.0))
        calls = [threading.Thread(target=_prefill, args=(prefill.address, i, errors)) for i in range(3)]
        for t in calls:
            t.start()
        deadline = time.monotonic() + 5
        while cluster.kvstore_client().stats().num_active_leases < 3:
            assert time.monotonic() < deadline, "the three calls never took their leases"
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING):
            prefill.stop()  # grace 0: the calls are cut while their handlers still run
        busy.result(timeout=5)
        for t in calls:
            t.join(timeout=10)
        assert cluster.kvstore_client().stats().num_active_leases == 0
        assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
        assert all(code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE) for code in errors), errors
    finally:
        cluster.prefills = []
        cluster.stop()


def _prefill(address: str, i: int, errors: list) -> None:
    request = prefill_pb2.PrefillRequest(req_id=f"r{i}", prompt_token_ids=list(range(10 + i, 90 + i)),
                                         sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    with channel(address) as ch:
        try:
            prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=30)
        except grpc.RpcError as e:
            errors.append(e.code())
