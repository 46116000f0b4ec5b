"""The sampling fields on the logits over HTTP (OpenAI's presence_penalty, frequency_penalty,
logit_bias with string keys; vLLM's repetition_penalty, min_tokens, bad_words,
allowed_token_ids): the offline engine's tokens, direct and disaggregated, completions and chat."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams

MAX_TOKENS = 10
SHORT = "The capital of France is"  # direct
LONG = "Once upon a time, in a village by the sea, there lived an old fisherman who " * 3  # via prefill
OPENAI = dict(presence_penalty=0.5, frequency_penalty=1.5, logit_bias={"100": 12.0, "200": -100.0})
VLLM = dict(repetition_penalty=1.3, min_tokens=MAX_TOKENS, bad_words=["the"])


def _engine_fields() -> dict:
    return dict(OPENAI, logit_bias={int(k): v for k, v in OPENAI["logit_bias"].items()}, **VLLM)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["direct", "disaggregated"])
def test_completion_with_every_field_matches_offline(client, llm, model, prompt):
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **_engine_fields()))[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert expected.token_ids != plain.token_ids
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **OPENAI,
                                  extra_body=VLLM)
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == len(expected.token_ids)


def test_chat_with_allowed_token_ids_matches_offline(client, llm, tokenizer, model):
    messages = [{"role": "user", "content": "Name a colour."}]
    allowed = sorted(set(tokenizer.encode(" red green blue yellow")) | {2})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, allowed_token_ids=allowed, presence_penalty=1.0)
    expected = llm.chat(messages, params)[0]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       presence_penalty=1.0, extra_body={"allowed_token_ids": allowed})
    assert r.choices[0].message.content == expected.text
    assert set(tokenizer.encode(expected.text)) <= set(allowed)
