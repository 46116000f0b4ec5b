"""Bad requests are refused with INVALID_ARGUMENT naming the field; the router keeps serving."""
from __future__ import annotations

import grpc
import pytest

from pdserve.engine import InvalidRequestError, SamplingParams
from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.router.config import default_slo_classes
from pdserve.services.router.core.model_info import ModelInfo
from pdserve.services.router.core.request import GenerateInput, RequestValidator
from tests.services.router.fakes import expected_tokens

GOOD = [5, 6, 7]


@pytest.mark.parametrize("prompt,fields,field", [
    ([], {}, "prompt"),
    ("", {}, "prompt"),
    (None, {}, "prompt"),
    (list(range(3, 2051)), {}, "prompt"),  # 2048 tokens: no room left to generate
    ([5, 49152], {}, "prompt_token_ids"),
    (GOOD, dict(sampling=common_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    (GOOD, dict(sampling=common_pb2.SamplingParams(temperature=-1.0)), "temperature"),
    (GOOD, dict(sampling=common_pb2.SamplingParams(top_p=2.0)), "top_p"),
    (GOOD, dict(sampling=common_pb2.SamplingParams(top_k=-2)), "top_k"),
    (GOOD, dict(sampling=common_pb2.SamplingParams(stop=[""])), "stop"),
    (GOOD, dict(slo_class="platinum"), "slo_class"),
    (GOOD, dict(model="another-model"), "model"),
])
def test_bad_input_is_invalid_argument_and_the_router_keeps_serving(cluster, prompt, fields, field):
    request = router_pb2.GenerateRequest(**fields)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt))
    with channel(cluster.router.address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"{field}:")
        assert all(not w.requests for w in cluster.prefills + cluster.decodes)
        good = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=GOOD),
                                          sampling=common_pb2.SamplingParams(max_tokens=2))
        assert [t for m in stub.Generate(good, timeout=30) for t in m.token_ids] == expected_tokens(3, 2)
    assert cluster.router.metrics.metrics.value("router_requests_total",
                                                {"slo_class": "none", "outcome": "invalid"}) == 1


def test_longest_prompt_that_fits_is_accepted(cluster):
    prompt = list(range(3, 2050))  # 2047 tokens: one position left to generate
    with channel(cluster.router.address) as ch:
        msgs = list(router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=30))
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(prompt), 1)


def test_max_model_len_from_config_lowers_the_limit(make_cluster):
    cluster = make_cluster(max_model_len=64)
    with channel(cluster.router.address) as ch, pytest.raises(grpc.RpcError) as e:
        list(router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=list(range(64)))), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.value.details()


def _validator(vocab_size: int = 49152) -> RequestValidator:
    classes = default_slo_classes()
    return RequestValidator(ModelInfo("m", "org/m", 2048, vocab_size), tokenizer=None, slo_classes=classes,
                            default_slo_class="interactive")


@pytest.mark.parametrize("sampling,field", [
    (SamplingParams(max_tokens=2**40), "max_tokens"),
    (SamplingParams(top_k=2**31), "top_k"),
    (SamplingParams(stop_token_ids=[5, 2**31]), "stop_token_ids"),
])
def test_values_the_worker_hop_cannot_carry_are_refused_naming_the_field(sampling, field):
    # the engine takes any int; the router -> worker wire only int32 (HTTP clients can send more)
    with pytest.raises(InvalidRequestError) as e:
        _validator().validate(GenerateInput(tuple(GOOD), sampling))
    assert e.value.field == field


def test_token_ids_are_bounded_by_the_wire_when_the_vocabulary_is_unknown():
    with pytest.raises(InvalidRequestError) as e:
        _validator(vocab_size=0).validate(GenerateInput((5, 2**31), SamplingParams()))
    assert e.value.field == "prompt_token_ids"


def test_one_input_from_either_front_routes_the_same():
    req = _validator().validate(GenerateInput(tuple(GOOD), SamplingParams(max_tokens=3, seed=7), req_id="r-1",
                                              slo_class="batch"))
    assert (req.client_req_id, req.prompt_token_ids, req.slo_class) == ("r-1", tuple(GOOD), "batch")
    assert len(req.req_id) == 32 and req.req_id != "r-1"  # the router's own id: clients cannot collide
    assert req.sampling.max_tokens == 3 and req.sampling.seed == 7 and not req.sampling.HasField("logprobs")


@pytest.mark.parametrize("sampling,field,vocab_size", [
    (SamplingParams(logit_bias={49152: 1.0}), "logit_bias", 49152),
    (SamplingParams(allowed_token_ids=[5, 49152]), "allowed_token_ids", 49152),
    (SamplingParams(allowed_token_ids=[5] * 49153), "allowed_token_ids", 49152),
    (SamplingParams(bad_words=["w"] * 129), "bad_words", 49152),
    (SamplingParams(bad_words=["w" * 257]), "bad_words", 49152),
    (SamplingParams(repetition_penalty=1e-50), "repetition_penalty", 49152),  # 0 as a float32
    (SamplingParams(repetition_penalty=1e39), "repetition_penalty", 49152),   # inf as a float32
    (SamplingParams(allowed_token_ids=[2**31]), "allowed_token_ids", 0),      # vocabulary unknown: the wire
    (SamplingParams(logit_bias={2**31: 1.0}), "logit_bias", 0),
])
def test_logits_fields_are_bounded_and_named(sampling, field, vocab_size):
    with pytest.raises(InvalidRequestError) as e:
        _validator(vocab_size).validate(GenerateInput(tuple(GOOD), sampling))
    assert e.value.field == field


def test_logits_fields_travel_to_the_workers():
    sampling = SamplingParams(repetition_penalty=1.25, presence_penalty=-0.5, frequency_penalty=0.75,
                              logit_bias={7: -100.0}, min_tokens=2, bad_words=["no"], allowed_token_ids=[7, 8])
    wire = _validator().validate(GenerateInput(tuple(GOOD), sampling)).sampling
    assert (wire.repetition_penalty, wire.presence_penalty, wire.frequency_penalty) == (1.25, -0.5, 0.75)
    assert dict(wire.logit_bias) == {7: -100.0} and wire.min_tokens == 2
    assert list(wire.bad_words) == ["no"] and list(wire.allowed_token_ids.ids) == [7, 8]


def test_truncate_minus_one_keeps_the_prompts_end_that_leaves_room_for_max_tokens():
    # -1 used to keep max_model_len tokens, which the next check refused ("no room to
    # generate"): every prompt longer than the context failed
    validator = _validator()
    long = tuple(range(3, 3 + 3000))
    routed = validator.validate(GenerateInput(long, SamplingParams(max_tokens=16), truncate_prompt_tokens=-1))
    assert routed.prompt_token_ids == long[-(2048 - 16):]
    whole = validator.validate(GenerateInput(long, SamplingParams(max_tokens=2048), truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == long[-1:]  # max_tokens the whole context: one prompt token stays
    short = (5, 6, 7)
    assert validator.validate(GenerateInput(short, SamplingParams(max_tokens=16),
                                            truncate_prompt_tokens=-1)).prompt_token_ids == short
    with pytest.raises(InvalidRequestError, match="^truncate_prompt_tokens: "):
        validator.validate(GenerateInput(short, SamplingParams(), truncate_prompt_tokens=-2))
