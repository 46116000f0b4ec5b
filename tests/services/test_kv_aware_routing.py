"""KV-aware placement with real processes' parts (in-process servers, real gRPC): a
prefill worker's KV events reach the router's index, and a follow-up sharing a long
prefix goes to the worker that holds it, though least-loaded would pick another."""
from __future__ import annotations

import time


from pdserve.engine import SamplingParams
from pdserve.services.common.convert import sampling_to_proto
from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import prefill_pb2, prefill_pb2_grpc
from pdserve.services.router.client import RouterClient
from tests.services.cluster import start_cluster

DOCUMENT = list(range(1000, 1160))       # 10 blocks of 16
FOLLOW_UP = DOCUMENT + list(range(3000, 3020))


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_follow_up_goes_to_the_worker_holding_its_prefix(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=2, num_decode=1)
    try:
        first, second = c.prefills
        router = c.router
        # warm the second-listed worker directly: least-loaded (all idle) would pick the first
        with channel(second.address) as ch:
            reply = prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(
                req_id="warm", prompt_token_ids=DOCUMENT,
                sampling=sampling_to_proto(SamplingParams(temperature=0, max_tokens=2))), timeout=60)
        addresses = [first.address, second.address]
        # the last document token is computed, so its block is not reusable: 9 blocks
        _wait_for(lambda: router.kv_index.match(addresses, FOLLOW_UP).local_tokens == {
            first.address: 0, second.address: 160})
        # the kvstore holds the blocks the prefill wrote: any worker could import them
        _wait_for(lambda: router.kv_index.match(addresses, FOLLOW_UP, store=c.kvstore.address).store_tokens == 160)
        c.kvstore_client().release_lease_quietly(reply.kv_handle.lease_id)  # (the write may end after the reply)
        hits_before = second.loop.stats.num_prefix_hit_tokens
        with RouterClient(router.address) as client:
            out = list(client.generate(FOLLOW_UP, SamplingParams(temperature=0, max_tokens=3), timeout_s=60))
        assert sum(len(m.token_ids) for m in out) == 3
        _wait_for(lambda: second.loop.stats.num_prefix_hit_tokens - hits_before == 160)
        assert first.loop.stats.num_prefix_queried_tokens == 0  # never asked
        value = router.metrics.metrics.value
        assert value("router_placement_total", {"pool": "prefill", "reason": "kv_hit"}) == 1
        device_blocks = {"source": second.address, "tier": "device"}
        _wait_for(lambda: value("router_kv_index_blocks", device_blocks) >= 10)  # each poll round
    finally:
        c.stop()


def test_a_stopped_worker_leaves_the_index(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1)
    try:
        with RouterClient(c.router.address) as client:
            list(client.generate(DOCUMENT, SamplingParams(temperature=0, max_tokens=2), timeout_s=60))
        address = c.prefills[0].address
        _wait_for(lambda: c.router.kv_index.num_blocks().get(address, 0) >= 9)
        c.prefills.pop().stop()
        _wait_for(lambda: address not in c.router.kv_index.num_blocks())
    finally:
        c.stop()
