"""A worker holding more open streams than a small RPC thread pool still answers its load
polls and health checks: each decode stream holds a server thread for its whole life, and
a poll that waits behind them times out; three in a row and the router takes the worker
for lost and cuts every stream it has (seen: 40 requests failed mid-stream at 4.5 req/s in
bench/serve_goodput.py, one decode worker with more than 32 streams open)."""
from __future__ import annotations

import threading
import time

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.services.common.grpc_server import channel
from pdserve.services.decode.server import serve as serve_decode
from pdserve.services.pb import common_pb2, decode_pb2, decode_pb2_grpc
from pdserve.services.worker.config import WorkerConfig

NUM_STREAMS = 48  # past the 32 threads a worker's server had
MAX_TOKENS = 3


def test_polls_are_answered_while_more_streams_than_before_wait(tiny_llama_dir, tiny, monkeypatch):
    gate = threading.Event()
    step = EngineCore.step

    def held_step(self):
        gate.wait(60)  # every stream stays open, holding its server thread, until released
        return step(self)

    monkeypatch.setattr(EngineCore, "step", held_step)
    cfg = WorkerConfig(engine=EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_cache_memory_bytes=8 << 20)),
                       metrics_port=None)
    worker = serve_decode(cfg, tiny)
    results: list[list[int] | Exception] = []

    def one_stream(i: int) -> None:
        try:
            with channel(worker.address) as ch:
                msgs = decode_pb2_grpc.DecodeWorkerStub(ch).Decode(decode_pb2.DecodeRequest(
                    req_id=f"r{i}", prompt_token_ids=[5, 6, 7, i],
                    sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)),
                    timeout=120)
                results.append([t for m in msgs for t in m.token_ids])
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results.append(e)

    threads = [threading.Thread(target=one_stream, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while worker.servicer.in_flight.count < NUM_STREAMS:
            assert time.monotonic() < deadline, f"only {worker.servicer.in_flight.count} streams got a thread"
            time.sleep(0.05)
        with channel(worker.address) as ch:  # as the router's poller asks, with its 1 s timeout
            load = decode_pb2_grpc.DecodeWorkerStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=1.0)
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        assert load.max_num_seqs > 0
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        gate.set()
        for t in threads:
            t.join(60)
        worker.stop()
    assert len(results) == NUM_STREAMS
    assert all(isinstance(r, list) and len(r) == MAX_TOKENS for r in results), results
