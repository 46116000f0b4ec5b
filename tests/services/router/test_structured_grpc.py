"""Structured outputs over Router.Generate: a bad spec is INVALID_ARGUMENT naming the field
before any worker sees the request; a good one reaches every worker of the request's path,
a resumed (migrated) request included. Fake workers: the spec is what is checked here, not
the masking (the engine's tests and the HTTP API's tests on a real worker do that)."""
from __future__ import annotations

import json

import grpc
import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.structured import StructuredOutputsParams
from pdserve.services.common.grpc_server import channel
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc
from pdserve.services.router.config import default_slo_classes
from pdserve.services.router.core.model_info import ModelInfo
from pdserve.services.router.core.request import GenerateInput, RequestValidator
from tests.services.router.fakes import expected_tokens

SHORT = [5, 6, 7]                # the direct path
LONG = list(range(200, 264))     # prefill -> decode
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
SO = common_pb2.StructuredOutputs


def _request(spec: common_pb2.StructuredOutputs, prompt=SHORT) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(
        max_tokens=3, structured_outputs=spec))


def _generate(cluster, request, timeout_s: float = 60) -> list:
    with channel(cluster.router.address) as ch:
        return list(router_pb2_grpc.RouterStub(ch).Generate(request, timeout=timeout_s))


def _refusal(cluster, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        _generate(cluster, request)
    return e.value


def _invalid(cluster) -> float:
    return cluster.router.metrics.metrics.value("router_requests_total", {"slo_class": "none", "outcome": "invalid"})


def _workers(cluster):
    return cluster.prefills + cluster.decodes


@pytest.mark.parametrize("spec,field,says", [
    (SO(json='{"type": "object"}', regex="a+"), "structured_outputs", "exactly one"),
    (SO(regex="a+", json_object=True), "structured_outputs", "exactly one"),
    (SO(), "structured_outputs", "exactly one"),
    (SO(choice=common_pb2.ChoiceList()), "structured_outputs.choice", "at least one"),
    (SO(choice=common_pb2.ChoiceList(choices=["yes", ""])), "structured_outputs.choice", "non-empty"),
    (SO(json="{not json"), "structured_outputs.json", "not valid JSON"),
    (SO(json='{"type": "nonsense"}'), "structured_outputs.json", "does not compile"),
    (SO(json='{"type": "integer", "minimum": 5, "maximum": 1}'), "structured_outputs.json", "does not compile"),
    (SO(json='{"properties": {"a": {"$ref": "#/nowhere"}}}'), "structured_outputs.json", "does not compile"),
    (SO(regex="a(b"), "structured_outputs.regex", "does not compile"),
    (SO(regex="[z-a]"), "structured_outputs.regex", "does not compile"),
    (SO(regex=""), "structured_outputs.regex", "non-empty"),
    (SO(grammar='root ::= undefined_rule'), "structured_outputs.grammar", "does not compile"),
    (SO(json=json.dumps({"description": "x" * 64 * 1024})), "structured_outputs.json", "characters"),
])
def test_a_bad_spec_is_invalid_argument_naming_the_field_and_reaches_no_worker(cluster, spec, field, says):
    error = _refusal(cluster, _request(spec))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}:") and says in error.details()
    assert all(not w.requests for w in _workers(cluster))
    assert _invalid(cluster) == 1
    # and the router goes on serving, a good spec included
    msgs = _generate(cluster, _request(SO(choice=common_pb2.ChoiceList(choices=["yes", "no"])), SHORT))
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(SHORT), 3)


def test_a_schema_nested_too_deeply_to_parse_is_invalid_argument(cluster):
    depth = 1500  # under the size limit, past Python's recursion limit
    schema = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
    error = _refusal(cluster, _request(SO(json=schema)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("structured_outputs.json:")
    assert all(not w.requests for w in _workers(cluster))


def test_a_spec_that_compiles_too_slowly_is_refused_not_waited_on(make_cluster):
    cluster = make_cluster(num_prefill=1, num_decode=1, grammar_compile_timeout_s=0.001)
    # ~60 ms to compile here (and the compiler's tokenizer table first): far past 1 ms
    big = {"type": "object", "required": [f"p{i}" for i in range(60)], "properties": {
        f"p{i}": {"type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]{3,9}"},
                                                    "y": {"type": "integer", "minimum": 0, "maximum": 1000}}}
        for i in range(60)}}
    error = _refusal(cluster, _request(SO(json=json.dumps(big))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "structured_outputs.json: did not compile within 0.001 s"
    assert all(not w.requests for w in _workers(cluster))


@pytest.mark.parametrize("prompt,pools", [(SHORT, ("decodes",)), (LONG, ("prefills", "decodes"))])
def test_the_spec_reaches_every_worker_of_the_path(cluster, client, prompt, pools):
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    msgs = list(client.generate(prompt, params, timeout_s=60))
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(prompt), 3)
    for pool in ("prefills", "decodes"):
        seen = [r for w in getattr(cluster, pool) for r in w.requests]
        assert len(seen) == (pool in pools)
        for request in seen:
            spec = request.sampling.structured_outputs
            assert request.sampling.HasField("structured_outputs") and spec.HasField("json")
            assert json.loads(spec.json) == SCHEMA and not spec.HasField("regex") and not spec.json_object


def test_a_migrated_request_keeps_its_spec(cluster, client):
    for d in cluster.decodes:
        d.fail_after = 2
    spec = StructuredOutputsParams(choice=["a", "b"])
    msgs = list(client.generate(LONG, SamplingParams(max_tokens=5, structured_outputs=spec), timeout_s=60))
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(len(LONG), 5)
    broken, resumed = sorted((r for d in cluster.decodes for r in d.requests), key=lambda r: len(r.output_token_ids))
    assert list(resumed.output_token_ids) == expected_tokens(len(LONG), 3)  # it did move
    for request in (broken, resumed):
        assert list(request.sampling.structured_outputs.choice.choices) == ["a", "b"]


def test_the_compiler_is_built_on_the_first_spec_not_at_startup(tokenizer):
    validator = RequestValidator(ModelInfo("m", "org/m", 2048, 49152), tokenizer, default_slo_classes(), "interactive")
    assert validator.grammars._compiler is None
    validator.validate(GenerateInput(tuple(SHORT), SamplingParams(max_tokens=2)))
    assert validator.grammars._compiler is None  # a request without a spec does not build it either
    routed = validator.validate(GenerateInput(tuple(SHORT), SamplingParams(
        max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))))
    assert validator.grammars._compiler is not None
    assert routed.sampling.structured_outputs.regex == "[0-9]+"  # as the workers receive it
