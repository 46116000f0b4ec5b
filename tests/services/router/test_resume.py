"""GenerateRequest.resume_token_ids (issue 49): a client whose router died sends the request
again, to any router, with the tokens it already received; the answer is what followed
them in the uninterrupted stream, token-exact for greedy and seeded sampling (penalties
over the output included), with usage counting every token. Bad resumes are refused
naming the field. A real cluster on loopback, one process; the router kill under load is
tests/cli/test_up_routers.py."""
from __future__ import annotations

import dataclasses

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.services.common.convert import sampling_to_proto
from pdserve.services.router.client import RouterClient, ResumingStream
from pdserve.services.pb import router_pb2
from pdserve.services.router.config import PathConfig, RouterConfig
from pdserve.services.router.server import serve as serve_router
from tests.services.cluster import start_cluster
from tests.services.test_disaggregated import assert_nothing_leaked

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3,
                        presence_penalty=0.4)
PROMPTS = {"long": list(range(5000, 5070)), "short": list(range(600, 610))}


@pytest.fixture(scope="module")
def cluster(tiny, tiny_llama_dir):
    c = start_cluster(tiny_llama_dir, tiny, num_prefill=1, num_decode=1)
    yield c
    try:
        assert_nothing_leaked(c)
    finally:
        c.stop()


def _stream(address, prompt, sampling, resume=()) -> list:
    request = router_pb2.GenerateRequest(token_ids={"ids": prompt}, resume_token_ids=list(resume))
    client = RouterClient(address)
    try:
        request.sampling.CopyFrom(sampling_to_proto(sampling))
        request.n = sampling.n
        return list(client._stub.Generate(request, timeout=60))
    finally:
        client.close()


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_a_resumed_stream_continues_exactly_after_the_tokens_given(cluster, prompt, sampling):
    whole = _stream(cluster.router.address, PROMPTS[prompt], sampling)
    tokens = _tokens(whole)
    assert len(tokens) == MAX_TOKENS
    for cut in (1, 9):
        resumed = _stream(cluster.router.address, PROMPTS[prompt], sampling, tokens[:cut])
        assert _tokens(resumed) == tokens[cut:]
        final = resumed[-1]
        assert final.finish_reason == whole[-1].finish_reason
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(PROMPTS[prompt]), MAX_TOKENS)
        # the text goes on where the client's ended (the worker replays the tokens given through its detokenizer)
        assert "".join(m.text for m in whole) == _text_upto(whole, cut) + "".join(m.text for m in resumed)


def _text_upto(msgs, num_tokens: int) -> str:
    """The text the first `num_tokens` tokens of the stream brought (messages of one token each)."""
    text, seen = [], 0
    for m in msgs:
        if seen >= num_tokens:
            break
        text.append(m.text)
        seen += len(m.token_ids)
    return "".join(text)


@pytest.mark.parametrize("change, message", [
    (lambda s: dataclasses.replace(s, n=2), "n 1"),
    (lambda s: dataclasses.replace(s, max_tokens=3), "the stream was complete"),
])
def test_a_resume_that_cannot_be_is_refused_naming_the_field(cluster, change, message):
    with pytest.raises(grpc.RpcError) as err:
        _stream(cluster.router.address, PROMPTS["short"], change(GREEDY), [1, 2, 3])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("resume_token_ids") and message in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _stream(cluster.router.address, PROMPTS["short"], GREEDY, [1 << 30])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "resume_token_ids" in err.value.details()


def test_the_client_goes_on_at_the_next_router_when_one_is_gone(cluster, tiny_llama_dir):
    """A second router on the same pools; the client names a dead address first: every
    request is served by the live one, and the client's later calls start there."""
    second = serve_router(RouterConfig(
        model=tiny_llama_dir, prefill_addresses=tuple(p.address for p in cluster.prefills),
        decode_addresses=tuple(d.address for d in cluster.decodes), kvstore_address=cluster.kvstore.address,
        paths=PathConfig(policy="threshold"), port=0, metrics_port=0))
    try:
        dead = "127.0.0.1:1"
        with RouterClient([dead, second.address]) as client:
            stream = client.generate(PROMPTS["long"], GREEDY, timeout_s=60)
            assert isinstance(stream, ResumingStream)
            tokens = _tokens(stream)
            assert tokens == _tokens(_stream(cluster.router.address, PROMPTS["long"], GREEDY))
            assert stream.num_resumes == 1 and client.address == dead and client._current == 1
    finally:
        second.stop()
