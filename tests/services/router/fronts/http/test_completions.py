"""POST /v1/completions with the official openai client (sync), against the offline engine."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams

MAX_TOKENS = 10
SHORT = "The capital of France is"  # <= 32 tokens: straight to the decode worker
LONG = "Once upon a time, in a village by the sea, there lived an old fisherman who " * 3  # via prefill + kvstore


def _offline(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw))[0]


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["direct", "disaggregated"])
def test_greedy_completion_matches_offline_engine(client, llm, tokenizer, model, prompt):
    expected = _offline(llm, prompt, logprobs=2)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == model and len(r.choices) == 1
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    # the same tokens, one by one, with the engine's logprobs
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    for top, lp in zip(choice.logprobs.top_logprobs, expected.logprobs):
        assert list(top) == [tokenizer.decode([t]) for t in sorted(lp.top_logprobs, key=lp.top_logprobs.get,
                                                                    reverse=True)]
    offsets = [sum(map(len, choice.logprobs.tokens[:i])) for i in range(len(expected.token_ids))]
    assert choice.logprobs.text_offset == offsets
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["direct", "disaggregated"])
def test_streamed_deltas_concatenate_to_the_whole_text(client, llm, model, prompt):
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text == _offline(llm, prompt).text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.usage is None for c in text_chunks) and len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump() == whole.usage.model_dump()


def test_batch_of_prompts_times_n(client, llm, tokenizer, model):
    prompts = [tokenizer.encode(SHORT), tokenizer.encode(LONG)]  # token ids, as a batch
    r = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=MAX_TOKENS, temperature=0)
    expected = [_offline(llm, {"prompt_token_ids": p}) for p in prompts]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    # a prompt is counted once, whatever n; every choice's tokens are counted
    assert r.usage.prompt_tokens == len(prompts[0]) + len(prompts[1])
    assert r.usage.completion_tokens == 2 * sum(len(e.token_ids) for e in expected)


@pytest.mark.parametrize("repeat", [1, 5], ids=["direct", "disaggregated"])
def test_cached_prompt_tokens_are_exact(client, llm, model, repeat):
    # no other prompt shares its first block: the first request finds nothing cached
    prompt = f"Prompt {repeat}, which no other test sends, about lighthouses and their keepers. " * repeat
    offline = [_offline(llm, prompt) for _ in range(2)]  # the engine's own count, cold then warm
    first, second = (client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
                     for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == offline[0].num_cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == offline[1].num_cached_tokens > 0
    assert [first.choices[0].text, second.choices[0].text] == [o.text for o in offline]


def test_stop_strings_and_seeded_sampling(client, llm, model):
    params = dict(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=11)
    expected = llm.generate(SHORT, SamplingParams(**params))[0]
    r = client.completions.create(model=model, prompt=SHORT, **params)
    assert r.choices[0].text == expected.text
    stop = expected.text[len(expected.text) // 2:][:3]
    stopped = client.completions.create(model=model, prompt=SHORT, stop=[stop], **params)
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert expected.text.startswith(stopped.choices[0].text)
