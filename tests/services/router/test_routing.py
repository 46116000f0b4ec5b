"""The router end to end against fake workers: which path a request takes, and the exact
stream, usage and timings the client gets."""
from __future__ import annotations

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.services.pb import common_pb2
from pdserve.services.router.client import RouterClient
from pdserve.services.router.decide.policy import PrefixAffinityPrefill
from pdserve.services.router.decide.views import WorkerView
from tests.services.router.fakes import DECODE_TIMINGS, PREFILL_TIMINGS, address_of, expected_tokens, piece

SHORT = list(range(100, 120))   # 20 tokens: at most short_prompt_tokens (32)
LONG = list(range(200, 260))    # 60 tokens: prefill, then decode


def _collect(client, prompt, max_tokens=5, **kw) -> list[common_pb2.GenerateResponse]:
    return list(client.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens), timeout_s=30, **kw))


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_short_prompt_goes_straight_to_decode(cluster, client):
    msgs = _collect(client, SHORT, req_id="short-1")
    assert _tokens(msgs) == expected_tokens(len(SHORT), 5)
    assert all(not p.requests for p in cluster.prefills)
    (request,) = [r for d in cluster.decodes for r in d.requests]
    assert not request.HasField("first_token_id") and not request.HasField("kv_handle")
    assert list(request.prompt_token_ids) == SHORT
    assert request.req_id != "short-1" and len(request.req_id) == 32  # the router's own: clients cannot collide
    assert request.priority == 0 and request.sampling.max_tokens == 5  # the interactive class travels as its priority
    assert {m.req_id for m in msgs} == {"short-1"}  # the client's id labels its responses


def test_long_prompt_prefills_then_decodes_first_token_first(cluster, client):
    msgs = _collect(client, LONG, slo_class="batch")
    first = 1000 + len(LONG)
    assert list(msgs[0].token_ids) == [first] and msgs[0].text == piece(first) and not msgs[0].finish_reason
    assert _tokens(msgs) == expected_tokens(len(LONG), 5)
    (prefill_req,) = [r for p in cluster.prefills for r in p.requests]
    (decode_req,) = [r for d in cluster.decodes for r in d.requests]
    assert list(prefill_req.prompt_token_ids) == LONG and prefill_req.priority == 1  # batch
    # the batch class's 30 s TTFT target, less the moments spent in the router: the deadline
    # the prefill worker's order keeps
    assert 29_000 < prefill_req.slo.ttft_budget_ms < 30_000
    # the tightest class target (interactive), whatever its own: how long its steps may last
    assert prefill_req.slo.min_class_ttft_ms == 1_000
    assert decode_req.first_token_id == first and decode_req.priority == 1
    assert decode_req.kv_handle.lease_id == f"lease-{prefill_req.req_id}"
    assert decode_req.req_id == prefill_req.req_id != ""  # assigned by the router
    assert {m.req_id for m in msgs} == {prefill_req.req_id}
    assert cluster.kvstore.releases == []  # the decode took the lease over


@pytest.mark.parametrize("prompt,cached", [(SHORT, 7), (LONG, 48)])
def test_stream_text_usage_and_timings_are_exact(cluster, client, prompt, cached):
    for p in cluster.prefills:
        p.num_cached_tokens = 48
    msgs = _collect(client, prompt, max_tokens=6)
    tokens = expected_tokens(len(prompt), 6)
    assert [list(m.token_ids) for m in msgs] == [[t] for t in tokens]
    assert "".join(m.text for m in msgs) == "".join(piece(t) for t in tokens)
    *body, final = msgs
    assert all(not m.finish_reason and not m.HasField("usage") for m in body)
    assert final.finish_reason == "length"
    # the cached count of a disaggregated request is the prefill's, not the decode's import
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_prompt_tokens) == \
        (len(prompt), 6, cached)
    parts = {**DECODE_TIMINGS, **(PREFILL_TIMINGS if prompt is LONG else {})}
    for name, value in parts.items():
        assert getattr(final.timings, name) == value
    assert 0 < final.timings.ttft_s and 0 <= final.timings.router_queue_s <= final.timings.ttft_s


def test_first_token_that_finishes_ends_the_stream_without_decode(cluster, client):
    for p in cluster.prefills:
        p.finish_reason = "stop"
    (msg,) = _collect(client, LONG)
    assert list(msg.token_ids) == [1000 + len(LONG)] and msg.finish_reason == "stop"
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (len(LONG), 1)
    assert msg.timings.prefill_s == PREFILL_TIMINGS["prefill_s"]
    assert all(not d.requests for d in cluster.decodes)
    assert cluster.kvstore.releases == []  # a finished prefill leaves no lease


@pytest.mark.parametrize("finish,handoff", [("", False), ("stop", True)])
def test_a_first_token_neither_or_both_ended_and_handed_off_is_internal(cluster, client, finish, handoff):
    for p in cluster.prefills:
        p.finish_reason, p.handoff = finish, handoff
    with pytest.raises(grpc.RpcError) as e:
        _collect(client, LONG)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "handed off" in e.value.details()
    assert all(not d.requests for d in cluster.decodes)
    (prefill_req,) = [r for p in cluster.prefills for r in p.requests]
    # a lease handed off is the router's to release when no decode takes it
    assert cluster.kvstore.releases == ([(f"lease-{prefill_req.req_id}", True)] if handoff else [])


def test_text_prompt_is_tokenized(cluster, client, tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    gen = client.generate_text(text, SamplingParams(max_tokens=3))
    assert gen.token_ids == expected_tokens(len(ids), 3)
    text_out, token_ids, finish_reason, usage = gen
    assert finish_reason == "length" and usage.prompt_tokens == len(ids) and token_ids == gen.token_ids
    (request,) = [r for w in cluster.prefills + cluster.decodes for r in w.requests]
    assert list(request.prompt_token_ids) == ids


def _prefix_preferring(address: str, addresses: list[str]) -> list[int]:
    """A 16-token leading block whose affinity worker is `address`."""
    policy = PrefixAffinityPrefill(max_extra_tokens=4096)
    views = [WorkerView(a, up=True) for a in addresses]
    for start in range(0, 10_000, 16):
        prefix = list(range(start, start + 16))
        if policy.preferred(views, prefix).address == address:
            return prefix
    raise AssertionError("no prefix found")


def test_prefix_affinity_keeps_each_prefix_on_its_worker(make_cluster):
    cluster = make_cluster(placement="affinity")
    client = RouterClient(cluster.router.address)
    addresses = [address_of(cluster, p) for p in cluster.prefills]
    prefixes = [_prefix_preferring(a, addresses) for a in reversed(addresses)]  # not the listing order
    for i in range(3):
        for n, prefix in enumerate(prefixes):
            prompt = prefix + list(range(5000 + 100 * i + 10 * n, 5000 + 100 * i + 10 * n + 30))
            assert _tokens(_collect(client, prompt, max_tokens=2)) == expected_tokens(len(prompt), 2)
    client.close()
    for worker, prefix in zip(reversed(cluster.prefills), prefixes):
        assert [list(r.prompt_token_ids[:16]) for r in worker.requests] == [prefix] * 3
    metrics = cluster.router.metrics.metrics
    assert metrics.value("router_placement_total", {"pool": "prefill", "reason": "affinity"}) == 6


def test_decode_choice_follows_reported_load(cluster, client):
    busy, idle = cluster.decodes
    busy.load.num_running = 6
    cluster.router.poll_now()
    for _ in range(3):
        _collect(client, SHORT, max_tokens=2)
    assert len(idle.requests) == 3 and not busy.requests


def test_list_models(cluster, client, tiny_llama_dir):
    (info,) = client.list_models()
    assert (info.id, info.max_model_len, info.vocab_size) == (tiny_llama_dir, 2048, 49152)


def test_model_name_may_be_given(cluster, client, tiny_llama_dir):
    assert _tokens(_collect(client, SHORT, max_tokens=2, model=tiny_llama_dir)) == expected_tokens(len(SHORT), 2)
