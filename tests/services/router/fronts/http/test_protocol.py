"""The wire itself: SSE framing and error JSON as curl sees them, /v1/models, /health,
/metrics, and clients that disconnect mid-request (their requests are aborted everywhere)."""
from __future__ import annotations

import json
import socket

import pytest

from pdserve.services.router.fronts.http.config import HttpConfig
from tests.services.router.fronts.http.support import raw_request, requests_total, start_router, wait_until

LONG = "Once upon a time, in a village by the sea, there lived an old fisherman who " * 3
ENDLESS = dict(max_tokens=1900, temperature=0, extra_body={"ignore_eos": True})  # far longer than any test runs


def test_sse_framing_as_curl_sees_it(cluster, model):
    request = {"model": model, "prompt": "Hello", "max_tokens": 6, "temperature": 0}
    _, _, whole = raw_request(cluster.router, "POST", "/v1/completions", request)
    status, headers, body = raw_request(cluster.router, "POST", "/v1/completions",
                                        dict(request, stream=True, stream_options={"include_usage": True}))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]  # the last event, then nothing
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    whole = json.loads(whole)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    _, _, plain = raw_request(cluster.router, "POST", "/v1/completions", dict(request, stream=True))
    assert all("usage" not in json.loads(e[len("data: "):]) for e in plain.decode().split("\n\n")[:-2])


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/completions", b'{"model": "m", "prompt": ', 400),
    ("POST", "/v1/chat/completions", b'["not", "an", "object"]', 400),
    ("GET", "/v1/nothing-here", None, 404),
    ("GET", "/v1/completions", None, 405),
])
def test_every_error_is_openai_json(cluster, method, path, body, status):
    got, headers, raw = raw_request(cluster.router, method, path, body)
    assert got == status and headers["content-type"] == "application/json"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_models_health_and_metrics(cluster, client, model):
    assert [m.id for m in client.models.list().data] == [model]
    status, _, body = raw_request(cluster.router, "GET", "/health")
    assert status == 200 and json.loads(body)["workers_up"] == {"prefill": 1, "decode": 1}
    client.completions.create(model=model, prompt="Hi", max_tokens=2)
    status, headers, body = raw_request(cluster.router, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'pdserve_router_requests_total{outcome="ok",slo_class="interactive"}' in body.decode()


# After the first chunk (the prefill's token) the disconnect may reach the decode worker
# while it still pulls the KV, before its abort callback is registered: the worker must
# abort then too, or the fixture's leak check waits for 1900 tokens and fails.
@pytest.mark.parametrize("num_chunks,max_tokens", [(1, 1900), (3, 1900)], ids=["after-prefill", "while-decoding"])
def test_disconnect_mid_stream_aborts_the_request(cluster, client, model, num_chunks, max_tokens):
    before = requests_total(cluster.router, "cancelled")
    stream = client.completions.create(model=model, prompt=LONG, stream=True, **dict(ENDLESS, max_tokens=max_tokens))
    chunks = [next(stream) for _ in range(num_chunks)]
    stream.close()
    assert all(c.choices[0].finish_reason is None for c in chunks)
    wait_until(lambda: requests_total(cluster.router, "cancelled") == before + 1, "the request counted as cancelled")
    # the `cluster` fixture then checks that every block is free and no lease is left


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(cluster, model):
    before = requests_total(cluster.router, "cancelled")
    decode = cluster.decodes[0].servicer.metrics.generated_tokens
    generated = decode._value.get()
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1900,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", cluster.router.http_port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: decode._value.get() >= generated + 2, "decoding under way")
    wait_until(lambda: requests_total(cluster.router, "cancelled") == before + 1, "the request counted as cancelled")


def test_a_taken_http_port_fails_the_router_start(shared_cluster, tiny, model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError, match="HTTP API: cannot listen"):
            start_router(shared_cluster, model, tiny.tokenizer, HttpConfig(port=taken.getsockname()[1]))
