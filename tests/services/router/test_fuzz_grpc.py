"""Router.Generate under random GenerateRequests (hypothesis), sent as raw bytes over a real
socket so that strings may hold what protobuf's own encoder refuses (lone surrogates): every
answer is OK or a client-side status, never INTERNAL or UNKNOWN, and the router lives on.
Bounded: a fixed number of examples against fake workers and a 64-token context."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc
from tests.services.router.fakes import expected_tokens, start_fake_cluster

MAX_EXAMPLES = 100
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS,
                 grpc.StatusCode.UNIMPLEMENTED}

INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
# mostly small values (the interesting edges), sometimes anything the field can carry
SMALL_INT = st.one_of(st.integers(-3, 70), INT32)
FLOAT = st.one_of(st.floats(-2, 3, width=32), st.floats(width=32))  # incl. nan, inf
TEXT = st.one_of(
    st.text(max_size=40),  # any code point, lone surrogates included
    st.sampled_from(["", "interactive", "batch", "\ud800", "abc \udfff def", "<|im_start|>system"]),
    st.integers(0, 20_000).map(lambda n: "x" * n))  # huge values


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string_field(number: int, value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")  # what a raw client may send
    return _varint((number << 3) | 2) + _varint(len(data)) + data


@st.composite
def sampling_bytes(draw) -> bytes:
    params = common_pb2.SamplingParams()
    for name, values in (("max_tokens", SMALL_INT), ("temperature", FLOAT), ("top_p", FLOAT),
                         ("top_k", SMALL_INT), ("min_p", FLOAT), ("logprobs", SMALL_INT),
                         ("seed", st.integers(-(1 << 63), (1 << 63) - 1)), ("repetition_penalty", FLOAT),
                         ("presence_penalty", FLOAT), ("frequency_penalty", FLOAT), ("min_tokens", SMALL_INT)):
        if draw(st.booleans()):
            setattr(params, name, draw(values))
    params.stop_token_ids.extend(draw(st.lists(INT32, max_size=5)))
    params.ignore_eos = draw(st.booleans())
    params.logit_bias.update(draw(st.dictionaries(SMALL_INT, FLOAT, max_size=4)))
    if draw(st.booleans()):
        params.allowed_token_ids.ids.extend(draw(st.lists(SMALL_INT, max_size=5)))
    stops, bad_words = draw(st.lists(TEXT, max_size=20)), draw(st.lists(TEXT, max_size=3))
    return (params.SerializeToString() + b"".join(_string_field(7, s) for s in stops)
            + b"".join(_string_field(17, w) for w in bad_words))


@st.composite
def generate_request_bytes(draw) -> bytes:
    msg = router_pb2.GenerateRequest()
    if draw(st.booleans()):
        msg.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 60_000), INT32), max_size=80)))
    raw = msg.SerializeToString()
    if draw(st.booleans()):
        raw += _string_field(2, draw(TEXT))  # the text prompt (the oneof's last value wins)
    sampling = draw(sampling_bytes())
    raw += _varint((4 << 3) | 2) + _varint(len(sampling)) + sampling
    for number in (1, 5, 6, 7):  # req_id, slo_class, model, cache_salt
        if draw(st.booleans()):
            raw += _string_field(number, draw(TEXT))
    return raw


@pytest.fixture(scope="module")
def router(tiny_llama_dir):
    from pdserve.engine import load_tokenizer
    cluster = start_fake_cluster(tiny_llama_dir, load_tokenizer(tiny_llama_dir), max_model_len=64)
    yield cluster.router
    cluster.stop()


@pytest.fixture(scope="module")
def generate(router):
    with channel(router.address) as ch:
        yield ch.unary_stream("/pdserve.v1.Router/Generate", request_serializer=lambda b: b,
                              response_deserializer=common_pb2.GenerateResponse.FromString)


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(raw=generate_request_bytes())
def test_no_request_is_a_server_fault(generate, raw):
    try:
        for _ in generate(raw, timeout=30):
            pass
    except grpc.RpcError as e:
        assert e.code() not in SERVER_FAULTS, f"{e.code()}: {e.details()}"
        assert "127.0.0.1" not in (e.details() or "")


def test_the_router_serves_after_the_fuzz(router):
    with channel(router.address) as ch:
        request = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
                                             sampling=common_pb2.SamplingParams(max_tokens=2))
        msgs = list(router_pb2_grpc.RouterStub(ch).Generate(request, timeout=30))
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(3, 2)
