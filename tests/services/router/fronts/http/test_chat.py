"""POST /v1/chat/completions with the official openai client (async), against LLM.chat."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.engine import SamplingParams
from tests.services.router.fronts.http.support import async_client

MAX_TOKENS = 10
SHORT = [{"role": "user", "content": "Hi!"}]  # with the template: <= 32 tokens, straight to decode
SYSTEM = ("You are a helpful assistant who knows geography well and answers every question in one short, "
          "friendly sentence, without lists.")
LONG = [{"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "Name three rivers "},
                                     {"type": "text", "text": "of Europe."}]}]
LONG_FLAT = [LONG[0], {"role": "user", "content": "Name three rivers of Europe."}]  # the same, as LLM.chat takes it


def _chat(router, **kw):
    async def go():
        async with async_client(router) as c:
            return await c.chat.completions.create(**kw)
    return asyncio.run(go())


def _stream(router, **kw) -> list:
    async def go():
        async with async_client(router) as c:
            return [chunk async for chunk in await c.chat.completions.create(stream=True, **kw)]
    return asyncio.run(go())


@pytest.mark.parametrize("messages,flat", [(SHORT, SHORT), (LONG, LONG_FLAT)], ids=["direct", "disaggregated"])
def test_greedy_chat_matches_llm_chat(cluster, llm, tokenizer, model, messages, flat):
    expected = llm.chat(flat, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    prefilled = cluster.prefills[0].servicer.metrics.prompt_tokens._value.get()
    r = _chat(cluster.router, model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)
    # the long conversation went through the prefill worker, the short one did not
    prefilled = cluster.prefills[0].servicer.metrics.prompt_tokens._value.get() - prefilled
    assert prefilled == (0 if messages is SHORT else len(expected.prompt_token_ids))


@pytest.mark.parametrize("messages", [SHORT, LONG], ids=["direct", "disaggregated"])
def test_streamed_chat_concatenates_to_the_whole_answer(cluster, model, messages):
    kw = dict(model=model, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0)
    whole = _chat(cluster.router, **kw)
    chunks = _stream(cluster.router, stream_options={"include_usage": True}, **kw)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks[:-1]]
    assert "".join(deltas) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_n_choices_seeded_with_logprobs(cluster, llm, model):
    params = dict(max_tokens=MAX_TOKENS, temperature=0.8, seed=7)
    r = _chat(cluster.router, model=model, messages=SHORT, n=3, logprobs=True, top_logprobs=3, **params)
    # choice i is an independent run with seed + i
    expected = [llm.chat(SHORT, SamplingParams(**dict(params, seed=7 + i), logprobs=3))[0] for i in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [e.text for e in expected]
    for choice, e in zip(r.choices, expected):
        content = choice.logprobs.content
        assert [t.logprob for t in content] == pytest.approx([lp.logprob for lp in e.logprobs], abs=1e-4)
        for t in content:
            assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
            assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    assert r.usage.prompt_tokens == len(expected[0].prompt_token_ids)
    assert r.usage.completion_tokens == sum(len(e.token_ids) for e in expected)


def test_streamed_n_choices_each_concatenate(cluster, llm, model):
    chunks = _stream(cluster.router, model=model, messages=LONG, n=2, max_tokens=MAX_TOKENS, temperature=0)
    expected = llm.chat(LONG_FLAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].text
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(2)]
    assert texts == [expected, expected]


def test_slo_class_from_header_and_body(cluster, model):
    before = [cluster.router.metrics.metrics.value("router_requests_total", {"slo_class": "batch", "outcome": "ok"})]
    _chat(cluster.router, model=model, messages=SHORT, max_tokens=2, extra_headers={"x-pdserve-slo": "batch"})
    _chat(cluster.router, model=model, messages=SHORT, max_tokens=2, extra_body={"slo_class": "batch"})
    after = cluster.router.metrics.metrics.value("router_requests_total", {"slo_class": "batch", "outcome": "ok"})
    assert after == before[0] + 2
