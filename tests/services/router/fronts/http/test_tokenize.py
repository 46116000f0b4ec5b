"""vLLM's extra endpoints on the router's HTTP API: POST /tokenize and /detokenize (the
tokens /v1/completions and /v1/chat/completions send), GET /version, and OpenAI's
GET /v1/models/{id}; behind the same API key and body bound as the rest."""
from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from pdserve.engine.chat import encode_chat_prompt
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.fronts.http.tokenize import _special_wrapping
from tests.services.router.fronts.http.support import raw_request, start_router

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
PROMPT = "The quick brown fox"


def _post(router, path: str, body, headers=None) -> tuple[int, dict]:
    status, _, raw = raw_request(router, "POST", path, body, headers)
    return status, json.loads(raw)


def _error(router, path: str, body) -> tuple[int, str | None, str | None]:
    status, out = _post(router, path, body)
    return status, out["error"]["param"], out["error"]["code"]


@pytest.fixture
def router(cluster):
    return cluster.router


def test_a_prompt_s_tokens_are_those_completions_send(router, model, tokenizer):
    status, out = _post(router, "/tokenize", {"model": model, "prompt": PROMPT})
    assert status == 200
    assert out == {"count": len(tokenizer.encode(PROMPT)), "max_model_len": router.servicer.model.max_model_len,
                   "tokens": tokenizer.encode(PROMPT)}
    # the model is optional (vLLM's), and token strings are there when asked for
    status, out = _post(router, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False,
                                              "return_token_strs": True})
    assert status == 200 and out["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])


def test_messages_tokens_are_those_chat_completions_send(router, model, tokenizer, client):
    status, out = _post(router, "/tokenize", {"model": model, "messages": MESSAGES})
    assert status == 200 and out["tokens"] == encode_chat_prompt(tokenizer, MESSAGES)[1]
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0)
    assert out["count"] == chat.usage.prompt_tokens


def test_without_the_generation_prompt(router, model, tokenizer):
    _, opened = _post(router, "/tokenize", {"model": model, "messages": MESSAGES})
    status, closed = _post(router, "/tokenize", {"model": model, "messages": MESSAGES, "add_generation_prompt": False})
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert status == 200 and closed["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert opened["tokens"][:closed["count"]] == closed["tokens"] and opened["count"] > closed["count"]


def test_detokenize_gives_the_text_back(router, model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    assert _post(router, "/detokenize", {"model": model, "tokens": ids}) == (200, {"prompt": tokenizer.decode(ids)})
    assert _post(router, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize("tokens,param", [([1, 10**6], "tokens"), ([-1], "tokens"), ([2**63], "tokens"),
                                          (["7"], "tokens[0]"), ([True], "tokens[0]"), ([1.5], "tokens[0]"),
                                          ("12", "tokens")])
def test_tokens_outside_the_vocabulary_or_not_ids_are_refused(router, tokens, param):
    assert _error(router, "/detokenize", {"tokens": tokens})[:2] == (400, param)


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),                                                   # neither form
    ({"prompt": "Hi", "messages": MESSAGES}, "prompt"),                 # both
    ({"prompt": 7}, "prompt"),
    ({"prompt": "abc \ud800"}, "prompt"),                               # not text
    ({"messages": "Hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"prompt": "Hi", "add_special_tokens": "maybe"}, "add_special_tokens"),
])
def test_a_bad_tokenize_body_is_a_400_naming_the_field(router, body, param):
    assert _error(router, "/tokenize", body)[:2] == (400, param)


def test_malformed_json_is_a_400(router):
    status, _, raw = raw_request(router, "POST", "/tokenize", b'{"prompt": ')
    assert status == 400 and "not valid JSON" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("path,body", [("/tokenize", {"model": "gpt-4o", "prompt": "Hi"}),
                                       ("/detokenize", {"model": "gpt-4o", "tokens": [1]})])
def test_an_unknown_model_is_not_found(router, path, body):
    assert _error(router, path, body) == (404, "model", "model_not_found")


def test_version_is_pdserve_s(router):
    status, _, raw = raw_request(router, "GET", "/version")
    assert status == 200 and json.loads(raw) == {"version": version("pdserve")}


def test_a_model_card_is_openai_s(router, model):
    status, _, raw = raw_request(router, "GET", f"/v1/models/{model}")
    card = json.loads(raw)
    assert status == 200 and (card["id"], card["object"], card["owned_by"]) == (model, "model", "pdserve")
    assert isinstance(card["created"], int)
    for unknown in ("gpt-4o", "org/name"):  # a name with a slash is a model id too, not another path
        status, _, raw = raw_request(router, "GET", f"/v1/models/{unknown}")
        error = json.loads(raw)["error"]
        assert (status, error["param"], error["code"], error["type"]) == (
            404, "model", "model_not_found", "invalid_request_error")


@pytest.fixture(scope="module")
def guarded(shared_cluster, tiny, tiny_llama_dir):
    """A router with an API key and a 2 KiB body bound."""
    router = start_router(shared_cluster, tiny_llama_dir, tiny.tokenizer,
                          HttpConfig(port=0, api_key="s3cret", max_request_bytes=2048))
    yield router
    router.stop(grace_s=1.0)


KEY = {"Authorization": "Bearer s3cret"}
ENDPOINTS = [("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
             ("GET", "/version", None)]


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
def test_the_api_key_guards_them(guarded, method, path, body):
    status, headers, raw = raw_request(guarded, method, path, body)
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert headers["www-authenticate"] == "Bearer"
    assert raw_request(guarded, method, path, body, {"Authorization": "Bearer wrong"})[0] == 401
    assert raw_request(guarded, method, path, body, KEY)[0] == 200


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "x" * 4096}),
                                       ("/detokenize", {"tokens": [1] * 2048})])
def test_a_body_over_the_bound_is_refused_unread(guarded, path, body):
    status, _, raw = raw_request(guarded, "POST", path, body, KEY)
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
    # a stranger's body is refused for its key first, never measured
    assert raw_request(guarded, "POST", path, body)[0] == 401


def test_special_wrapping_is_read_off_the_tokenizer():
    class BosTokenizer:
        def encode(self, text, add_special_tokens=True):
            ids = [ord(c) for c in text]
            return [1, *ids, 2] if add_special_tokens else ids

    assert _special_wrapping(BosTokenizer()) == ([1], [2])
