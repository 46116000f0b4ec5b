"""Hostile input at the router's gRPC port: every value is bounded and refused with
INVALID_ARGUMENT naming its field (never RESOURCE_EXHAUSTED, INTERNAL or UNKNOWN), a
client's request id cannot collide with another's on a worker, and no error names a
worker's address. Validator and scrub units first, then real sockets (fake workers)."""
from __future__ import annotations

import logging
import threading

import grpc
import pytest

from pdserve.engine import InvalidRequestError, SamplingParams
from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.router.config import default_slo_classes
from pdserve.services.router.core.model_info import ModelInfo
from pdserve.services.router.core.request import MAX_STOP_STRINGS, GenerateInput, RequestValidator
from pdserve.services.router.errors import HIDDEN, RouterError, scrub
from tests.services.router.fakes import expected_tokens, start_fake_cluster

SHORT = list(range(5, 13))
LONG = list(range(5, 45))  # past the fake cluster's 32-token threshold: prefill -> kvstore -> decode


def _validator(max_model_len: int = 2048) -> RequestValidator:
    return RequestValidator(ModelInfo("m", "org/m", max_model_len, 49152), tokenizer=None,
                            slo_classes=default_slo_classes(), default_slo_class="interactive")


@pytest.mark.parametrize("inp,field", [
    (GenerateInput((5,), SamplingParams(max_tokens=2049)), "max_tokens"),
    (GenerateInput((5,), SamplingParams(logprobs=21)), "logprobs"),
    (GenerateInput((5,), SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))), "stop"),
    (GenerateInput((5,), SamplingParams(stop=["x" * 10_000])), "stop"),
    (GenerateInput((5,), SamplingParams(stop=["a\ud800b"])), "stop"),
    (GenerateInput((5,), SamplingParams(stop_token_ids=[5] * 10_000)), "stop_token_ids"),
    (GenerateInput("abc \ud800 def", SamplingParams()), "prompt"),
    (GenerateInput("x" * (64 * 2048 + 1), SamplingParams()), "prompt"),  # refused untokenized
    (GenerateInput((5,), SamplingParams(), slo_class="s" * 10_000), "slo_class"),
    (GenerateInput((5,), SamplingParams(), model="m" * 10_000), "model"),
    (GenerateInput((5,), SamplingParams(), req_id="r" * 10_000), "req_id"),
])
def test_each_cap_names_its_field_and_quotes_little(inp, field):
    with pytest.raises(InvalidRequestError) as e:
        _validator().validate(inp)  # tokenizer=None: a text prompt reaching the tokenizer would fail otherwise
    assert e.value.field == field and len(str(e.value)) < 300
    str(e.value).encode("utf-8")  # sendable as a gRPC status or JSON: no surrogate quoted back


def test_the_router_names_every_request_itself():
    a, b = (_validator().validate(GenerateInput((5,), SamplingParams(), req_id="same")) for _ in range(2))
    assert a.req_id != b.req_id and a.client_req_id == b.client_req_id == "same"


@pytest.mark.parametrize("message", [
    "decode worker 127.0.0.1:50051 failed: boom",
    "prefill worker decode-0.pdserve.svc.cluster.local:7000 failed: x",
    "UNAVAILABLE: ipv4:10.1.2.3:1234: Connection refused",
    "failed to connect; last error: ipv6:%5B::1%5D:555: refused",
    "peer [fe80::1]:80 reset",
    "kvstore at 10.0.0.7 is gone",
])
def test_addresses_are_scrubbed_from_client_messages(message):
    out = scrub(message)
    assert HIDDEN in out
    for fragment in ("127.0.0.1", "decode-0", "10.1.2.3", "::1", "fe80", "10.0.0.7", "50051", "7000"):
        assert fragment not in out


def test_field_errors_are_left_alone():
    for message in ("prompt: has 12 tokens; the context (max_model_len) is 2048", "temperature: must be >= 0"):
        assert scrub(message) == message


def test_router_error_keeps_the_address_for_the_log(caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.services.router.errors"):
        e = RouterError(grpc.StatusCode.INTERNAL, "decode worker 127.0.0.1:9 failed: x")
    assert "127.0.0.1" not in e.message and "127.0.0.1:9" in e.detail and "127.0.0.1:9" in caplog.text


# --- over real sockets ---------------------------------------------------------------

@pytest.fixture(scope="module")
def fakes(tiny_llama_dir):
    from pdserve.engine import load_tokenizer
    cluster = start_fake_cluster(tiny_llama_dir, load_tokenizer(tiny_llama_dir), max_model_len=64)
    yield cluster
    cluster.stop()


@pytest.fixture
def stub(fakes):
    with channel(fakes.router.address) as ch:
        yield router_pb2_grpc.RouterStub(ch)
    for worker in fakes.prefills + fakes.decodes:
        worker.requests.clear()
        worker.fail_with = None


def _request(prompt=SHORT, max_tokens=3, **fields) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt),
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens), **fields)


def _refusal(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=30))
    return e.value


@pytest.mark.parametrize("fields,field", [
    (dict(slo_class="s" * 10_240), "slo_class"),  # was RESOURCE_EXHAUSTED: the echo overflowed the trailers
    (dict(model="m" * 10_240), "model"),
    (dict(req_id="r" * 10_240), "req_id"),
    (dict(max_tokens=65), "max_tokens"),
])
def test_oversized_fields_are_invalid_argument(stub, fields, field):
    max_tokens = fields.pop("max_tokens", 3)
    e = _refusal(stub, _request(max_tokens=max_tokens, **fields))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(f"{field}:")
    assert len(e.details()) < 300


def test_a_string_that_is_not_utf8_is_invalid_argument_not_internal(fakes):
    # a lone surrogate as a raw client would encode it: protobuf refuses to parse the message
    text = "abc \ud800 def".encode("utf-8", "surrogatepass")
    raw = bytes([(2 << 3) | 2, len(text)]) + text  # field 2 (text), length-delimited
    with channel(fakes.router.address) as ch:
        generate = ch.unary_stream("/pdserve.v1.Router/Generate", request_serializer=lambda b: b,
                                   response_deserializer=common_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(generate(raw, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in e.value.details()


def test_colliding_client_ids_stay_apart_on_the_workers(fakes, stub):
    # two clients choose the same id for long prompts at once: each hand-off keeps its own KV lease
    results = {}

    def generate(name, prompt):
        results[name] = list(stub.Generate(_request(prompt, max_tokens=4, req_id="same"), timeout=30))
    threads = [threading.Thread(target=generate, args=(n, p)) for n, p in (("a", LONG), ("b", LONG[1:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [t for m in results["a"] for t in m.token_ids] == expected_tokens(len(LONG), 4)
    assert [t for m in results["b"] for t in m.token_ids] == expected_tokens(len(LONG) - 1, 4)
    assert {m.req_id for msgs in results.values() for m in msgs} == {"same"}
    prefill_ids = {r.req_id for p in fakes.prefills for r in p.requests}
    decode_leases = {r.kv_handle.lease_id for d in fakes.decodes for r in d.requests}
    assert len(prefill_ids) == 2 and "same" not in prefill_ids
    assert decode_leases == {f"lease-{i}" for i in prefill_ids}


def test_worker_failures_do_not_tell_the_client_where_workers_are(fakes, stub, caplog):
    for d in fakes.decodes:
        d.fail_with = grpc.StatusCode.INVALID_ARGUMENT  # not retried: its message is the client's
    with caplog.at_level(logging.WARNING, logger="pdserve.services.router.errors"):
        e = _refusal(stub, _request())
    assert "decode worker" in e.details() and "127.0.0.1" not in e.details()
    assert all(str(fakes.servers[d].port) not in e.details() for d in fakes.decodes)
    assert "127.0.0.1" in caplog.text  # the operator still learns which one


def test_the_router_still_serves(stub):
    assert [t for m in stub.Generate(_request(), timeout=30) for t in m.token_ids] == expected_tokens(len(SHORT), 3)
