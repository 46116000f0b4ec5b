"""End to end through router -> prefill -> kvstore -> decode, against the offline engine."""
from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import (common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2,
                                 router_pb2_grpc)
from pdserve.services.router.client import RouterClient
from pdserve.services.router.decide.config import default_slo_classes
from pdserve.services.kvstore.stores.base import hash_key
from tests.services.cluster import start_cluster

MAX_TOKENS = 12
SHORT = [[11, 12, 13], list(range(300, 320))]
LONG = [list(range(1000, 1100)), list(range(2000, 2077)), list(range(1000, 1060)) + list(range(5000, 5040))]


@pytest.fixture(scope="module")
def offline(tiny, tiny_llama_dir):
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {tuple(p): o for p, o in zip(SHORT + LONG, llm.generate([{"prompt_token_ids": p} for p in SHORT + LONG],
                                                                    params))}


@pytest.fixture
def cluster(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny)
    yield c
    try:
        assert_nothing_leaked(c)
    finally:
        c.stop()


def assert_nothing_leaked(c, timeout_s: float = 10.0) -> None:
    """Every worker's block pool fully free and no lease left in the kvstore."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = [w.loop.call(lambda e: e.kv_manager.num_free_blocks == e.kv_manager.pool.num_blocks
                            and not e.has_unfinished_requests()).result() for w in c.workers()]
        leases = c.kvstore_client().stats().num_active_leases
        if all(free) and leases == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked: workers free={free}, active leases={leases}")
        time.sleep(0.1)


def _generate(router_address: str, prompt, max_tokens: int = MAX_TOKENS, **kw):
    client = RouterClient(router_address)
    try:
        msgs = list(client.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), **kw))
    finally:
        client.close()
    return msgs


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]



def assert_decodes_reused(decodes, num_tokens: int) -> None:
    """The decode workers computed none of these prompts' KV: each token was imported from
    the kvstore or found in their own prefix cache (LONG[0] and LONG[2] share 3 blocks: a
    decode holding them reads only what follows). Run concurrently, a read may still
    fetch blocks the cache gains before admission, so the sum can pass the tokens."""
    imported = sum(d.servicer.metrics.kvstore_imported._value.get() for d in decodes)
    hits = sum(d.loop.stats.num_prefix_hit_tokens for d in decodes)
    assert imported <= num_tokens <= imported + hits
    assert sum(d.servicer.metrics.recompute._value.get() for d in decodes) == 0

def test_concurrent_long_and_short_match_offline(cluster, offline):
    prompts = SHORT + LONG
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: _generate(cluster.router.address, p), prompts))
    for p, msgs in zip(prompts, results):
        expected = offline[tuple(p)]
        assert _tokens(msgs) == expected.token_ids
        assert "".join(m.text for m in msgs) == expected.text
        final = msgs[-1]
        assert final.finish_reason == expected.finish_reason
        assert final.usage.prompt_tokens == len(p) and final.usage.completion_tokens == len(expected.token_ids)
    # the long prompts went prefill -> kvstore -> decode; the short ones did not
    prefilled = sum(w.servicer.metrics.prompt_tokens._value.get() for w in cluster.prefills)
    assert prefilled == sum(map(len, LONG))
    assert_decodes_reused(cluster.decodes, sum(map(len, LONG)))
    assert cluster.kvstore_client().stats().num_blocks >= sum(len(p) // 16 for p in LONG) - 3


PENALISED = dict(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.2,
                 logit_bias={100: 12.0, 200: -100.0}, min_tokens=8)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5)], ids=["greedy", "seeded"])
def test_penalties_bias_and_min_tokens_match_offline(cluster, tiny, tiny_llama_dir, offline, sampling):
    # disaggregated: the prefill worker samples the first token, the decode worker the rest,
    # counting that first token in the penalties and toward min_tokens; direct: one decode worker
    params = SamplingParams(max_tokens=MAX_TOKENS, **sampling, **PENALISED)
    prompts = [SHORT[1], LONG[0]]
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False)
    expected = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, want, path in zip(prompts, expected, ("direct", "disaggregated")):
        with RouterClient(cluster.router.address) as client:
            msgs = list(client.generate(prompt, params))
        assert _tokens(msgs) == want.token_ids and msgs[-1].path == path
        assert "".join(m.text for m in msgs) == want.text
        if not sampling.get("seed"):
            assert want.token_ids != offline[tuple(prompt)].token_ids


def test_colocated_router_sends_every_prompt_to_decode_workers(tiny, tiny_llama_dir, offline):
    # no prefill pool: even prompts far over the direct-path threshold are prefilled by
    # the decode workers themselves, nothing goes through the kvstore (nor, here, is
    # written to it after they finish: tests/services/test_finished_kv_e2e.py)
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=0, num_decode=2, short_prompt_tokens=0,
                      kv_write_finished=False)
    try:
        prompts = SHORT + LONG
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: _generate(c.router.address, p), prompts))
        for p, msgs in zip(prompts, results):
            assert _tokens(msgs) == offline[tuple(p)].token_ids
        assert sum(d.servicer.metrics.prompt_tokens._value.get() for d in c.decodes) == sum(map(len, prompts))
        assert all(d.servicer.metrics.prompt_tokens._value.get() > 0 for d in c.decodes)  # both took work
        assert sum(d.servicer.metrics.kvstore_imported._value.get() for d in c.decodes) == 0
        assert c.kvstore_client().stats().num_blocks == 0
        assert_nothing_leaked(c)
    finally:
        c.stop()


def _prefill_direct(worker, prompt, req_id: str, max_tokens: int = MAX_TOKENS):
    with channel(worker.address) as ch:
        return prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(
            req_id=req_id, prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)))


@pytest.mark.parametrize("field", ["ttft_budget_ms", "min_class_ttft_ms"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_bad_ttft_budget_or_target_is_invalid_argument(cluster, offline, field, value):
    with channel(cluster.prefills[0].address) as ch, pytest.raises(grpc.RpcError) as e:
        prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(
            req_id="bad-budget", prompt_token_ids=LONG[0], slo=common_pb2.SLOTargets(**{field: value}),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(f"slo.{field}: ")
    # one token: it ends on the prefill worker, no KV handed over
    assert _prefill_direct(cluster.prefills[0], LONG[0], "after", max_tokens=1).choices[0].token_id == \
        offline[tuple(LONG[0])].token_ids[0]


def test_the_ttft_budget_reaches_the_engine_less_the_time_spent_on_the_worker_the_target_whole(
        cluster, monkeypatch):
    worker = cluster.prefills[0]
    sent = []
    submit = worker.servicer.loop.submit
    monkeypatch.setattr(worker.servicer.loop, "submit", lambda r: sent.append(r) or submit(r))
    with channel(worker.address) as ch:
        prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(
            req_id="budget", prompt_token_ids=LONG[0],
            slo=common_pb2.SLOTargets(ttft_budget_ms=4000.0, min_class_ttft_ms=6000.0),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1)))
    (request,) = sent
    assert 3.0 < request.slo.ttft_budget_s < 4.0 and request.slo.min_class_ttft_s == 6.0


@pytest.mark.parametrize("target_ms", [-1.0, float("nan"), float("inf")])
def test_a_bad_itl_target_is_invalid_argument(cluster, offline, target_ms):
    with channel(cluster.decodes[0].address) as ch, pytest.raises(grpc.RpcError) as e:
        list(decode_pb2_grpc.DecodeWorkerStub(ch).Decode(decode_pb2.DecodeRequest(
            req_id="bad-target", prompt_token_ids=SHORT[0], slo=common_pb2.SLOTargets(itl_target_ms=target_ms),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("slo.itl_target_ms: ")
    assert _tokens(_generate(cluster.router.address, SHORT[0])) == offline[tuple(SHORT[0])].token_ids


def test_each_decode_carries_its_class_itl_target_to_the_engine(cluster, monkeypatch):
    """Direct and handed-over streams alike: the engine keeps their TPOT room under it."""
    sent = []
    for worker in cluster.decodes:
        submit = worker.servicer.loop.submit
        monkeypatch.setattr(worker.servicer.loop, "submit", lambda r, submit=submit: sent.append(r) or submit(r))
    for prompt, slo in ((SHORT[0], "interactive"), (LONG[0], "interactive"), (LONG[1], "batch")):
        _generate(cluster.router.address, prompt, slo_class=slo)
    itl_ms = {name: c.itl_ms for name, c in default_slo_classes().items()}  # the cluster's router
    assert [r.slo.itl_target_s for r in sent] == [itl_ms["interactive"] / 1000, itl_ms["interactive"] / 1000,
                                              itl_ms["batch"] / 1000]


def _decode_direct(worker, prompt, first: int, handle, req_id: str):
    with channel(worker.address) as ch:
        return list(decode_pb2_grpc.DecodeWorkerStub(ch).Decode(decode_pb2.DecodeRequest(
            req_id=req_id, prompt_token_ids=prompt, first_token_id=first, kv_handle=handle,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))))


def test_prefix_reuse_across_prefill_workers(cluster, offline):
    a, b = cluster.prefills
    first = _prefill_direct(a, LONG[0], "a")
    _decode_direct(cluster.decodes[0], LONG[0], first.choices[0].token_id, first.kv_handle, "a")
    shared = LONG[2]  # shares 60 tokens (3 full blocks) with LONG[0]
    reply = _prefill_direct(b, shared, "b")
    msgs = _decode_direct(cluster.decodes[0], shared, reply.choices[0].token_id, reply.kv_handle, "b")
    assert reply.num_cached_tokens == 48  # 3 of its 6 full blocks came from A's prefill
    assert b.servicer.metrics.kvstore_imported._value.get() == 48
    assert [reply.choices[0].token_id] + _tokens(msgs) == offline[tuple(shared)].token_ids


def test_evicted_block_is_recomputed(cluster, offline, monkeypatch):
    reply = _prefill_direct(cluster.prefills[0], LONG[1], "e")
    handle = reply.kv_handle
    store = cluster.kvstore.store
    evicted, real_get = hash_key(handle.block_hashes[2]), store.get
    # the store answers as if it no longer had block 2 (the decode asks by its own hashes)
    monkeypatch.setattr(store, "get", lambda keys: [None if k == evicted else b for k, b in zip(keys, real_get(keys))])
    decode = cluster.decodes[0]
    before = decode.servicer.metrics.recompute._value.get()
    msgs = _decode_direct(decode, LONG[1], reply.choices[0].token_id, handle, "e")
    assert [reply.choices[0].token_id] + _tokens(msgs) == offline[tuple(LONG[1])].token_ids
    assert decode.servicer.metrics.recompute._value.get() > before


def test_dead_prefill_worker_is_retried(cluster, offline):
    cluster.prefills[0].stop()
    try:
        for p in LONG:
            assert _tokens(_generate(cluster.router.address, p)) == offline[tuple(p)].token_ids
    finally:
        cluster.prefills = cluster.prefills[1:]


def test_client_cancel_frees_blocks_and_lease(cluster):
    client = RouterClient(cluster.router.address)
    stream = client.generate(LONG[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(iter(stream))
    stream.cancel()
    client.close()
    assert_nothing_leaked(cluster)


@pytest.mark.parametrize("sampling,prompt,slo,field", [
    (dict(max_tokens=4), [], "interactive", "prompt"),
    (dict(max_tokens=4), list(range(3, 2100)), "interactive", "prompt"),
    (dict(max_tokens=4, temperature=-1.0), [5, 6], "interactive", "temperature"),
    (dict(max_tokens=4, top_p=2.0), [5, 6], "interactive", "top_p"),
    (dict(max_tokens=0), [5, 6], "interactive", "max_tokens"),
    (dict(max_tokens=4), [5, 6], "platinum", "slo_class"),
])
def test_bad_input_is_invalid_argument(cluster, offline, sampling, prompt, slo, field):
    request = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), slo_class=slo,
                                         sampling=common_pb2.SamplingParams(**sampling))
    with channel(cluster.router.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(router_pb2_grpc.RouterStub(ch).Generate(request))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    assert _tokens(_generate(cluster.router.address, SHORT[0])) == offline[tuple(SHORT[0])].token_ids


def _scrape(port: int) -> tuple[str, dict[str, float]]:
    """A worker's /metrics text, and its samples as 'name' or 'name{label="value"}' -> value."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return body, samples


def test_workers_serve_their_metrics(cluster):
    long_msgs = _generate(cluster.router.address, LONG[0])    # a prefill worker, then the decode
    short_msgs = _generate(cluster.router.address, SHORT[0])  # the decode alone
    decode = cluster.decodes[0]
    ok = 'pdserve_worker_requests_total{outcome="ok"}'
    deadline = time.monotonic() + 10  # the decode counts a request once its stream has ended
    while _scrape(decode.metrics_port)[1].get(ok) != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    for worker in cluster.workers():
        body, _ = _scrape(worker.metrics_port)
        for name in ("pdserve_worker_ttft_seconds", "pdserve_worker_itl_seconds", "pdserve_kv_blocks_free",
                     "pdserve_requests_running", "pdserve_prefix_cache_hit_tokens", "pdserve_recompute_fallbacks_total"):
            assert name in body
    decode_body, d = _scrape(decode.metrics_port)
    assert 'pdserve_kv_transfer_seconds_count{direction="read"} 1.0' in decode_body

    # The prefills, together: one request, one first token, no token after it.
    prefills = [_scrape(p.metrics_port)[1] for p in cluster.prefills]
    total = lambda name: sum(s.get(name, 0.0) for s in prefills)  # noqa: E731
    assert total("pdserve_worker_ttft_seconds_count") == 1
    assert total("pdserve_worker_itl_seconds_count") == 0
    assert total("pdserve_prefill_tokens_total") == len(LONG[0])
    assert total("pdserve_decode_tokens_total") == 0
    assert total(ok) == 1

    # The decode: the long prompt continues from the prefill's first token (the router sends
    # that one itself), so its first message has no gap before it here; the short prompt is
    # prefilled here, so its first message is this worker's first token.
    long_steps, short_steps = len(long_msgs) - 1, len(short_msgs)
    assert long_steps > 1 and short_steps > 1
    assert d["pdserve_worker_ttft_seconds_count"] == 1
    assert d["pdserve_worker_itl_seconds_count"] == (long_steps - 1) + (short_steps - 1)
    assert d["pdserve_decode_tokens_total"] == len(_tokens(long_msgs)) - 1 + len(_tokens(short_msgs))
    assert d["pdserve_prefill_tokens_total"] == len(SHORT[0])
    assert d[ok] == 2


def test_smollm2_through_the_platform(smollm2_path):
    loaded = load_model(resolve_model("smollm2"), torch.float32, "cpu", progress=False)
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.encode("Once upon a time, in a village by the sea, there lived an old fisherman who " * 3)]
    expected = LLM("smollm2", loaded_model=loaded, progress=False).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    c = start_cluster("smollm2", loaded, num_prefill=1, num_decode=1, kv_cache_memory_bytes=64 << 20)
    try:
        for p, e in zip(prompts, expected):
            msgs = _generate(c.router.address, p)
            assert _tokens(msgs) == e.token_ids and "".join(m.text for m in msgs) == e.text
        assert c.prefills[0].servicer.metrics.prompt_tokens._value.get() == len(prompts[1])
        assert_nothing_leaked(c)
    finally:
        c.stop()


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_kv_moves_over_ucx_and_tcp(tiny, tiny_llama_dir, offline, transport):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, kvstore_transport=transport)
    try:
        with ThreadPoolExecutor(len(LONG)) as pool:
            results = list(pool.map(lambda p: _generate(c.router.address, p), LONG))
        for p, msgs in zip(LONG, results):
            assert _tokens(msgs) == offline[tuple(p)].token_ids
        assert_decodes_reused(c.decodes, sum(map(len, LONG)))
        assert c.kvstore.ucx_address if transport == "ucx" else c.kvstore.tcp_address
        assert c.kvstore.metrics.get_bytes.labels(transport)._value.get() > 0  # the bytes went that way
        assert_nothing_leaked(c)
    finally:
        c.stop()
