"""Completions' echo (the prompt before the text, and its tokens' logprobs before the
output's) and vLLM's prompt_logprobs, over HTTP, streamed and not, on both paths; against
the offline engine."""
from __future__ import annotations

import json

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.chat import encode_chat_prompt
from tests.services.router.fronts.http.support import raw_request

MAX_TOKENS = 6
TOP = 2
SHORT = "The capital of France is"  # the direct path
LONG = "Once upon a time, in a village by the sea, there lived an old fisherman who " * 3  # disaggregated
PATHS = pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["direct", "disaggregated"])


def _offline(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw))[0]


def _post(cluster, path: str, body: dict) -> tuple[int, dict]:
    status, _, data = raw_request(cluster.router, "POST", path, body)
    return status, json.loads(data)


def _stream(cluster, path: str, body: dict) -> list[dict]:
    status, _, data = raw_request(cluster.router, "POST", path, dict(body, stream=True))
    assert status == 200, data
    events = [line[len(b"data: "):] for line in data.split(b"\n\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _legacy_prompt_part(out, tokenizer, top: int) -> dict:
    """The offline engine's prompt logprobs in the legacy format, as an echo shows them."""
    tokens = [tokenizer.decode([t]) for t in out.prompt_token_ids]
    logprobs = [None] + [e[t].logprob for t, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    tops = [None] + [[tokenizer.decode([t]) for t, _ in sorted(((t, lp.logprob) for t, lp in e.items()
                                                                if lp.rank <= top), key=lambda kv: -kv[1])]
                     for e in out.prompt_logprobs[1:]]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops}


def _assert_logprobs(got: list, want: list) -> None:
    assert [g is None for g in got] == [w is None for w in want]
    assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], abs=1e-4)


@PATHS
def test_echo_prepends_the_prompt(cluster, llm, model, prompt):
    expected = _offline(llm, prompt)
    status, r = _post(cluster, "/v1/completions", dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0, echo=True))
    assert status == 200 and r["choices"][0]["text"] == prompt + expected.text
    assert r["choices"][0]["logprobs"] is None and "prompt_logprobs" not in r["choices"][0]
    assert r["usage"]["completion_tokens"] == len(expected.token_ids)


def test_echo_of_a_batch_with_n_gives_every_choice_its_own_prompt(cluster, llm, tokenizer, model):
    prompts = [SHORT, "Mountains are"]
    status, r = _post(cluster, "/v1/completions", dict(model=model, prompt=prompts, n=2, max_tokens=MAX_TOKENS,
                                                       temperature=0, echo=True, logprobs=1))
    assert status == 200 and len(r["choices"]) == 4, r
    for i, choice in enumerate(r["choices"]):  # prompt-major: choices 0, 1 of the first prompt
        expected = _offline(llm, prompts[i // 2])
        assert choice["text"] == prompts[i // 2] + expected.text
        assert len(choice["logprobs"]["tokens"]) == len(tokenizer.encode(prompts[i // 2])) + len(expected.token_ids)


@PATHS
def test_echo_with_logprobs_has_the_prompt_tokens_first(cluster, llm, tokenizer, model, prompt):
    expected = _offline(llm, prompt, logprobs=TOP, prompt_logprobs=TOP)
    status, r = _post(cluster, "/v1/completions", dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0, echo=True, logprobs=TOP))
    assert status == 200
    choice, num_prompt = r["choices"][0], len(expected.prompt_token_ids)
    lp = choice["logprobs"]
    assert choice["text"] == prompt + expected.text
    assert lp["tokens"] == [tokenizer.decode([t]) for t in expected.prompt_token_ids + expected.token_ids]
    want = _legacy_prompt_part(expected, tokenizer, TOP)
    _assert_logprobs(lp["token_logprobs"][:num_prompt], want["token_logprobs"])
    assert lp["token_logprobs"][num_prompt:] == pytest.approx([x.logprob for x in expected.logprobs], abs=1e-4)
    assert lp["top_logprobs"][0] is None
    assert [list(t) for t in lp["top_logprobs"][1:num_prompt]] == want["top_logprobs"][1:]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    # vLLM's prompt_logprobs ride along in the choice: computed for the echo
    assert len(choice["prompt_logprobs"]) == num_prompt and choice["prompt_logprobs"][0] is None


@PATHS
def test_streamed_echo_comes_in_the_first_chunk(cluster, model, prompt):
    body = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True, logprobs=1)
    status, whole = _post(cluster, "/v1/completions", body)
    chunks = _stream(cluster, "/v1/completions", body)
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    streamed = {k: [v for c in chunks for v in c["choices"][0]["logprobs"][k]] for k in ("tokens", "text_offset")}
    assert streamed == {k: whole["choices"][0]["logprobs"][k] for k in ("tokens", "text_offset")}
    _assert_logprobs([v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]],
                     whole["choices"][0]["logprobs"]["token_logprobs"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_max_tokens_0_is_the_prompt_alone(cluster, llm, tokenizer, model, stream):
    ids = tokenizer.encode(LONG)
    body = dict(model=model, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    if stream:
        chunks = _stream(cluster, "/v1/completions", body)
        choice = {"text": "".join(c["choices"][0]["text"] for c in chunks),
                  "finish_reason": chunks[-1]["choices"][0]["finish_reason"],
                  "tokens": [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]}
    else:
        status, r = _post(cluster, "/v1/completions", body)
        assert status == 200 and r["usage"]["completion_tokens"] == 0
        choice = dict(r["choices"][0], tokens=r["choices"][0]["logprobs"]["tokens"])
    assert choice["text"] == tokenizer.decode(ids)  # a token-id prompt, decoded
    assert choice["finish_reason"] == "length"
    assert choice["tokens"] == [tokenizer.decode([t]) for t in ids]
    # without echo, max_tokens 0 is still refused
    status, r = _post(cluster, "/v1/completions", dict(model=model, prompt=ids, max_tokens=0))
    assert status == 400 and r["error"]["param"] == "max_tokens"


@PATHS
def test_completions_prompt_logprobs_in_each_choice(cluster, llm, tokenizer, model, prompt):
    expected = _offline(llm, prompt, prompt_logprobs=TOP)
    status, r = _post(cluster, "/v1/completions", dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                       temperature=0, prompt_logprobs=TOP, n=2))
    assert status == 200
    for choice in r["choices"]:
        assert choice["text"] == expected.text
        _assert_vllm_form(choice["prompt_logprobs"], expected)


def _assert_vllm_form(got: list, expected) -> None:
    """vLLM's JSON: [null, {"id": {"logprob", "rank", "decoded_token"}}, ...]."""
    assert got[0] is None and len(got) == len(expected.prompt_logprobs)
    for entry, want in zip(got[1:], expected.prompt_logprobs[1:]):
        assert list(entry) == [str(t) for t in want]  # the prompt token first, then the top N
        for token_id, lp in want.items():
            assert entry[str(token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert (entry[str(token_id)]["rank"], entry[str(token_id)]["decoded_token"]) == (lp.rank, lp.decoded_token)


def test_chat_prompt_logprobs_beside_the_choices(cluster, llm, tokenizer, model):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    ids = encode_chat_prompt(tokenizer, messages)[1]
    expected = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                      prompt_logprobs=1))[0]
    status, r = _post(cluster, "/v1/chat/completions", dict(model=model, messages=messages, temperature=0,
                                                            max_tokens=MAX_TOKENS, prompt_logprobs=1))
    assert status == 200 and r["choices"][0]["message"]["content"] == expected.text
    _assert_vllm_form(r["prompt_logprobs"], expected)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": SHORT}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_prompt_logprobs_with_a_stream_is_refused_as_vllm_does(cluster, model, path, body):
    status, r = _post(cluster, path, dict(body, model=model, prompt_logprobs=1, stream=True))
    assert status == 400 and r["error"]["param"] == "prompt_logprobs"
    status, r = _post(cluster, path, dict(body, model=model, prompt_logprobs=21))
    assert status == 400 and r["error"]["param"] == "prompt_logprobs"
    assert _stream(cluster, path, dict(body, model=model, prompt_logprobs=0, max_tokens=2))  # 0: accepted
