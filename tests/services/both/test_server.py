"""A worker of both roles in this process: one engine behind PrefillWorker and DecodeWorker,
one load report for both pools, and a drain that ends both servicers' work."""
from __future__ import annotations

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.services.both.server import serve
from pdserve.services.common.grpc_server import channel
from pdserve.services.kvstore.server import KVStoreConfig
from pdserve.services.kvstore.server import serve as serve_kvstore
from pdserve.services.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdserve.services.worker.config import WorkerConfig

GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=6)
PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks and a tail


def test_one_engine_serves_both_services_and_both_pools_read_one_report(tiny_llama_dir, tiny):
    kvstore = serve_kvstore(KVStoreConfig(capacity_bytes=64 << 20, metrics_port=None))
    cfg = WorkerConfig(engine=EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_cache_memory_bytes=8 << 20)),
                       kvstore_address=kvstore.address, metrics_port=0)
    worker = serve(cfg, tiny)
    try:
        with channel(worker.address) as ch:
            prefill, decode = prefill_pb2_grpc.PrefillWorkerStub(ch), decode_pb2_grpc.DecodeWorkerStub(ch)
            reply = prefill.Prefill(prefill_pb2.PrefillRequest(req_id="p", prompt_token_ids=PROMPT, sampling=GREEDY))
            assert reply.kv_handle.num_tokens == len(PROMPT) and reply.choices[0].handoff
            # the hand-off's other end on the same engine: what a router never asks, yet exact
            handed = list(decode.Decode(decode_pb2.DecodeRequest(
                req_id="p", prompt_token_ids=PROMPT, first_token_id=reply.choices[0].token_id,
                kv_handle=reply.kv_handle, sampling=GREEDY)))
            direct = list(decode.Decode(decode_pb2.DecodeRequest(req_id="d", prompt_token_ids=PROMPT,
                                                                 sampling=GREEDY)))
            assert [reply.choices[0].token_id, *(t for m in handed for t in m.token_ids)] == \
                [t for m in direct for t in m.token_ids]
            loads = [stub.GetLoad(common_pb2.GetLoadRequest()) for stub in (prefill, decode)]
        assert loads[0] == loads[1]
        assert loads[0].prefill_tokens_per_s > 0 and loads[0].decode_step_ms > 0
        assert {type(s).__name__ for s in worker.servicers} == {"PrefillServicer", "DecodeServicer"}
        assert worker.servicers[0].metrics is worker.servicers[1].metrics  # one /metrics for the process
    finally:
        worker.stop()
        kvstore.stop()
    assert all(s.draining for s in worker.servicers)
