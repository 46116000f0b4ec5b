"""The prefill's KV write off the first token's path (issue 13), on a real cluster: the
first token comes back while the write is still running, the decode's read waits on the
lease until it ends, a failed write is recomputed with the same greedy tokens, and the
prefix a prefill found in the store stays pinned for its decode."""
from __future__ import annotations

import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.services.kvstore.client import KVStoreFullError
from tests.services.cluster import start_cluster
from tests.services.test_disaggregated import LONG, MAX_TOKENS, _decode_direct, _prefill_direct, _tokens, \
    assert_nothing_leaked

WRITE_DELAY_S = 1.0


@pytest.fixture(scope="module")
def offline(tiny, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in LONG], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {tuple(p): o.token_ids for p, o in zip(LONG, outs)}


@pytest.fixture(params=["grpc", "tcp", "ucx"])
def cluster(request, tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, kvstore_transport=request.param)
    yield c
    try:
        assert_nothing_leaked(c)
    finally:
        c.stop()


def _slow_writes(monkeypatch, prefill, delay_s: float) -> None:
    client = prefill.servicer.kvstore
    put_blocks = client.put_blocks

    def late(*args, **kwargs):
        time.sleep(delay_s)
        return put_blocks(*args, **kwargs)
    monkeypatch.setattr(client, "put_blocks", late)


def test_the_first_token_does_not_wait_and_the_decode_waits_for_the_write(cluster, offline, monkeypatch):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    _slow_writes(monkeypatch, prefill, WRITE_DELAY_S)
    prompt = LONG[1]
    start = time.monotonic()
    reply = _prefill_direct(prefill, prompt, "slow")
    assert time.monotonic() - start < WRITE_DELAY_S  # answered while the write sleeps
    assert reply.kv_handle.lease_id and reply.timings.kv_write_s < WRITE_DELAY_S / 2
    msgs = _decode_direct(decode, prompt, reply.choices[0].token_id, reply.kv_handle, "slow")
    assert [reply.choices[0].token_id] + _tokens(msgs) == offline[tuple(prompt)]
    # it read every block once written: nothing recomputed, and the read took the wait
    assert decode.servicer.metrics.kvstore_imported._value.get() == len(prompt)
    assert decode.servicer.metrics.recompute._value.get() == 0
    assert msgs[-1].timings.kv_read_s > WRITE_DELAY_S / 2


def test_a_failed_write_is_recomputed_with_the_same_tokens(cluster, offline, monkeypatch):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]

    def full(*args, **kwargs):
        raise KVStoreFullError("no room (test)")
    monkeypatch.setattr(prefill.servicer.kvstore, "put_blocks", full)
    prompt = LONG[0]
    reply = _prefill_direct(prefill, prompt, "fails")
    msgs = _decode_direct(decode, prompt, reply.choices[0].token_id, reply.kv_handle, "fails")
    assert [reply.choices[0].token_id] + _tokens(msgs) == offline[tuple(prompt)]
    assert prefill.servicer.metrics.kv_write_failures._value.get() == 1
    num_blocks = len(reply.kv_handle.block_hashes) + bool(reply.kv_handle.tail_key)
    assert decode.servicer.metrics.recompute._value.get() == num_blocks
    assert decode.servicer.metrics.kvstore_imported._value.get() == 0


def test_the_prefix_found_in_the_store_is_pinned_until_the_decode_reads(cluster, offline):
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    first = _prefill_direct(prefill, LONG[0], "a")
    _decode_direct(decode, LONG[0], first.choices[0].token_id, first.kv_handle, "a")
    # LONG[2] shares 3 full blocks with LONG[0]: found in the store, not written again
    reply = _prefill_direct(prefill, LONG[2], "b")
    handle = reply.kv_handle
    assert reply.num_cached_tokens == 48 and len(handle.block_hashes) == 6 and handle.tail_key
    store = cluster.kvstore_client()
    deadline = time.monotonic() + 10
    while store.stats().num_pinned_blocks < 7 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats().num_pinned_blocks == 7  # 3 found + 3 written + the tail, all by its lease
    msgs = _decode_direct(decode, LONG[2], reply.choices[0].token_id, handle, "b")
    assert [reply.choices[0].token_id] + _tokens(msgs) == offline[tuple(LONG[2])]
    assert store.stats().num_pinned_blocks == 0
