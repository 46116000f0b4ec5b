"""Every failure comes back in OpenAI's error shape, as the openai client's matching
exception: 400 naming the field, 401, 404, 429 with Retry-After, 503."""
from __future__ import annotations

import asyncio

import openai
import pytest

from pdserve.services.router.config import SaturationConfig, SLOClass
from pdserve.services.router.fronts.http.config import HttpConfig
from tests.services.router.fronts.http.support import async_client, free_port, raw_request, start_router, sync_client

MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("endpoint,kwargs,param", [
    ("completions", dict(prompt="Hi", temperature=-1), "temperature"),
    ("completions", dict(prompt="Hi", top_p=2), "top_p"),
    ("completions", dict(prompt="Hi", max_tokens=0), "max_tokens"),
    ("completions", dict(prompt="Hi", max_tokens=2**40), "max_tokens"),
    ("completions", dict(prompt="Hi", presence_penalty=2.5), "presence_penalty"),
    ("completions", dict(prompt="Hi", frequency_penalty=-3), "frequency_penalty"),
    ("completions", dict(prompt="Hi", logit_bias={"five": 1}), "logit_bias"),
    ("completions", dict(prompt="Hi", logit_bias={"5": 101}), "logit_bias"),
    ("completions", dict(prompt="Hi", logit_bias={"49152": 1}), "logit_bias"),
    ("completions", dict(prompt="Hi", extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    ("completions", dict(prompt="Hi", max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
    ("completions", dict(prompt="Hi", extra_body={"bad_words": [" "]}), "bad_words"),
    ("chat", dict(messages=MSGS, extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
    ("chat", dict(messages=MSGS, extra_body={"allowed_token_ids": [5, 10**6]}), "allowed_token_ids"),
    ("chat", dict(messages=MSGS, logit_bias={"-1": 1}), "logit_bias"),
    ("completions", dict(prompt="Hi", logprobs=21), "logprobs"),
    ("completions", dict(prompt="Hi", n=0), "n"),
    ("chat", dict(messages=MSGS, extra_body={"continue_final_message": True}), "continue_final_message"),
    ("chat", dict(messages=MSGS, extra_body={"chat_template_kwargs": {"tokenize": True}}), "chat_template_kwargs.tokenize"),
    ("completions", dict(prompt="Hi", extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens"),
    ("completions", dict(prompt="Hi", extra_body={"use_beam_search": True}), "use_beam_search"),
    ("completions", dict(prompt=""), "prompt"),
    ("completions", dict(prompt="word " * 2100), "prompt"),
    ("completions", dict(prompt=[10**8]), "prompt"),
    ("completions", dict(prompt="Hi", extra_body={"slo_class": "platinum"}), "slo_class"),
    ("completions", dict(prompt="Hi", extra_body={"max_tokens": "many"}), "max_tokens"),
    ("completions", dict(prompt="Hi", seed=-1), "seed"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(messages=[{"content": "no role"}]), "messages[0].role"),
    ("chat", dict(messages=MSGS, top_logprobs=2), "top_logprobs"),
    ("chat", dict(messages=MSGS, logprobs=True, top_logprobs=50), "top_logprobs"),
    ("chat", dict(messages=MSGS, max_completion_tokens=0), "max_completion_tokens"),
    ("chat", dict(messages=MSGS, stream_options={"include_usage": True}), "stream_options"),
    ("chat", dict(messages=MSGS, tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),  # "auto"
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content"),
])
def test_bad_field_is_bad_request_naming_it(client, model, endpoint, kwargs, param):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model=model, **kwargs)
    assert e.value.status_code == 400 and e.value.param == param and e.value.type == "invalid_request_error"
    assert param.split("[")[0] in e.value.message


def test_bad_field_in_a_stream_request_is_still_a_status(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MSGS, temperature=-2, stream=True)
    assert e.value.param == "temperature"


def test_unknown_model_is_not_found(client, model):
    for create in (lambda m: client.completions.create(model=m, prompt="Hi"),
                   lambda m: client.chat.completions.create(model=m, messages=MSGS),
                   client.models.retrieve):
        with pytest.raises(openai.NotFoundError) as e:
            create("gpt-4o")
        assert e.value.code == "model_not_found" and e.value.param == "model"
    assert client.models.retrieve(model).id == model


def test_api_key_is_required_when_set(shared_cluster, tiny, model):
    router = start_router(shared_cluster, model, tiny.tokenizer, HttpConfig(port=0, api_key="s3cret"))
    try:
        with sync_client(router, api_key="wrong") as c, pytest.raises(openai.AuthenticationError) as e:
            c.models.list()
        assert e.value.code == "invalid_api_key"
        status, headers, body = raw_request(router, "POST", "/v1/completions", {"model": model, "prompt": "Hi"})
        assert status == 401 and b'"invalid_api_key"' in body
        for open_path in ("/health", "/metrics"):  # probes and Prometheus need no key
            assert raw_request(router, "GET", open_path)[0] == 200

        async def right_key():
            async with async_client(router, api_key="s3cret") as c:
                return await c.completions.create(model=model, prompt="Hi", max_tokens=3)
        assert asyncio.run(right_key()).usage.completion_tokens > 0
    finally:
        router.stop()


def test_refused_admission_is_rate_limited_with_retry_after(shared_cluster, tiny, model):
    # every worker saturated (no request may be in flight) and no waiting: refused at once
    router = start_router(shared_cluster, model, tiny.tokenizer, retry_after_ms=1500,
                          saturation=SaturationConfig(max_in_flight_per_worker=0),
                          slo_classes={"interactive": SLOClass(ttft_ms=1000, itl_ms=100, max_queue_ms=0)})
    try:
        with sync_client(router) as c:
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as e:
                    c.completions.create(model=model, prompt="Hi", max_tokens=3, stream=stream)
                headers = e.value.response.headers
                assert headers["retry-after"] == "2" and headers["retry-after-ms"] == "1500"
                assert e.value.code == "rate_limit_exceeded"
        rejected = router.metrics.metrics.value("router_admission_rejections_total",
                                                {"pool": "decode", "slo_class": "interactive"})
        assert rejected == 2
    finally:
        router.stop()


def test_no_reachable_worker_is_unavailable(shared_cluster, tiny, model):
    nowhere = [f"127.0.0.1:{free_port()}"]
    router = start_router(shared_cluster, model, tiny.tokenizer, prefill=nowhere, decode=nowhere)
    try:
        with sync_client(router) as c:
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as e:
                    c.chat.completions.create(model=model, messages=MSGS, max_tokens=3, stream=stream)
                assert e.value.status_code == 503 and e.value.code == "no_worker_available"
        status, _, body = raw_request(router, "GET", "/health")
        assert status == 503 and b'"unavailable"' in body
    finally:
        router.stop()
