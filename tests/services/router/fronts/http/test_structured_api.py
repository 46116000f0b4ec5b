"""Structured outputs through the OpenAI API, with the official client, against the router in
front of real workers on the tiny random model: response_format, vLLM's structured_outputs
and tools with a forcing tool_choice. A random model writes valid JSON, a matching regex or
a tool call only when the grammar masks its logits, so every answer here is parsed and
validated against its schema. Bad specs are 400 naming the field, before any worker runs."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.services.router.fronts.http.support import raw_request, requests_total

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
# a long conversation: past the router's direct-path limit, it goes prefill -> kvstore -> decode
LONG_MSGS = [{"role": "user", "content": "Tell me about the weather in Paris, Oslo and Lima this week. " * 4}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}}, "required": ["query"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
PARAMETERS = {"get_weather": WEATHER, "search": SEARCH}
MAX_TOKENS = 160  # far more than any answer the schemas allow takes
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS)
# a random model pads JSON with whitespace forever when it may (tool calls never may)
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _worker_tokens(cluster) -> float:
    return sum(w.servicer.metrics.metrics.value(name) for w in cluster.workers()
               for name in ("prefill_tokens_total", "decode_tokens_total"))


# ---- bad input: 400 naming the field, nothing runs --------------------------------------

NAMED = {"type": "function", "function": {"name": "search"}}


@pytest.mark.parametrize("endpoint,kwargs,param", [
    ("chat", dict(response_format=_json_schema({"type": "nonsense"})), "response_format.json_schema.schema"),
    ("chat", dict(response_format=_json_schema({"type": "integer", "minimum": 3, "maximum": 1})),
     "response_format.json_schema.schema"),
    ("chat", dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema"),
    ("chat", dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    ("chat", dict(response_format={"type": "xml"}), "response_format.type"),
    ("chat", dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a+"}}),
     "structured_outputs"),
    ("chat", dict(extra_body={"structured_outputs": {"regex": "a+", "choice": ["a"]}}), "structured_outputs"),
    ("chat", dict(extra_body={"structured_outputs": {}}), "structured_outputs"),
    ("chat", dict(extra_body={"structured_outputs": {"choice": []}}), "structured_outputs.choice"),
    ("chat", dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs.regex"),
    ("chat", dict(extra_body={"structured_outputs": {"json": "{oops"}}), "structured_outputs.json"),
    ("chat", dict(extra_body={"structured_outputs": {"grammar": "root ::= nowhere"}}), "structured_outputs.grammar"),
    ("chat", dict(extra_body={"structured_outputs": {"structural_tag": "x"}}), "structured_outputs.structural_tag"),
    ("chat", dict(extra_body={"guided_json": WEATHER}), "guided_json"),
    ("chat", dict(extra_body=COMPACT), "structured_outputs.disable_any_whitespace"),
    ("chat", dict(extra_body={"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}),
     "structured_outputs.disable_any_whitespace"),
    ("chat", dict(tools=TOOLS), "tool_choice"),  # defaults to "auto": no --enable-auto-tool-choice here
    ("chat", dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),
    ("chat", dict(tool_choice="required"), "tools"),
    ("chat", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name"),
    ("chat", dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ("chat", dict(tools=TOOLS, tool_choice=NAMED, extra_body={"structured_outputs": {"regex": "a"}}),
     "structured_outputs"),
    ("chat", dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "get_weather"}}], tool_choice="required"),
     "tools[1].function.name"),
    ("chat", dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "search", "parameters": {
        "type": "nonsense"}}}], tool_choice=NAMED), "tools[1].function.parameters"),
    ("chat", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                  tool_choice="required"), "tools"),
    ("chat", dict(tools=[{"type": "function"}], tool_choice="required"), "tools[0].function"),
    ("completions", dict(extra_body={"response_format": _json_schema({"$ref": "#/nowhere"})}),
     "response_format.json_schema.schema"),
    ("completions", dict(extra_body={"structured_outputs": {"regex": "[z-a]"}}), "structured_outputs.regex"),
    ("completions", dict(extra_body={"structured_outputs": {"choice": ["yes", ""]}}), "structured_outputs.choice"),
])
def test_a_bad_spec_is_bad_request_naming_the_field(cluster, client, model, endpoint, kwargs, param):
    before_invalid, before_work = requests_total(cluster.router, "invalid", "none"), _worker_tokens(cluster)
    if endpoint == "chat":
        create = lambda **kw: client.chat.completions.create(messages=MSGS, **kw)  # noqa: E731
    else:
        create = lambda **kw: client.completions.create(prompt="Hi", **kw)  # noqa: E731
    with pytest.raises(openai.BadRequestError) as e:
        create(model=model, max_tokens=4, **kwargs)
    assert e.value.status_code == 400 and e.value.param == param, e.value.message
    assert e.value.body["message"].startswith(f"{param}:")
    assert requests_total(cluster.router, "invalid", "none") == before_invalid + 1
    assert _worker_tokens(cluster) == before_work  # refused by the router: no worker computed anything


def test_a_deeply_nested_schema_is_refused_not_a_server_error(cluster, model):
    depth = 3000  # written by hand: Python's own json module cannot encode it
    schema = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
    body = (f'{{"model": {json.dumps(model)}, "messages": {json.dumps(MSGS)}, "max_tokens": 4, '
            f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}}}}}}}')
    status, _, reply = raw_request(cluster.router, "POST", "/v1/chat/completions", body.encode())
    assert status == 400, reply


def test_openapi_describes_the_structured_fields(cluster):
    status, _, body = raw_request(cluster.router, "GET", "/openapi.json")
    assert status == 200
    schemas = json.loads(body)["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    for name in ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls"):
        assert name in chat
    assert {"response_format", "structured_outputs"} <= set(schemas["CompletionRequest"]["properties"])
    assert set(schemas["StructuredOutputs"]["properties"]) == {"json", "regex", "choice", "grammar", "json_object",
                                                                "disable_any_whitespace"}
    assert "schema" in schemas["JsonSchemaFormat"]["properties"]


# ---- guided answers (need the engine's logits mask) ------------------------------------

@pytest.mark.parametrize("messages", [MSGS, LONG_MSGS], ids=["direct", "disaggregated"])
def test_json_schema_answer_parses_and_validates(cluster, client, model, messages):
    reply = client.chat.completions.create(model=model, messages=messages, **GREEDY,
                                           response_format=_json_schema(WEATHER), extra_body=COMPACT)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_json_object_answer_starts_an_object(cluster, client, model):
    # any object may hold any string: a random model never closes one, so only the start is checked
    def reply(**kw):
        return client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=6, **kw)
    guided = reply(response_format={"type": "json_object"}, extra_body=COMPACT).choices[0].message.content
    assert re.match(r'\{("|\})', guided), guided
    assert not reply().choices[0].message.content.startswith("{")  # the grammar made the difference


def test_choice_and_regex_through_completions(cluster, client, model):
    choices = ["sunny", "rainy", "snow"]
    reply = client.completions.create(model=model, prompt="The weather is", max_tokens=MAX_TOKENS, n=2, seed=3,
                                      temperature=1.0, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in reply.choices)
    pattern = r"[0-9]{3}-[a-z]{2}"
    reply = client.completions.create(model=model, prompt="Code:", **GREEDY,
                                      extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, reply.choices[0].text), reply.choices[0].text


def _check_call(call, name: str | None = None) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name if name else call.function.name in PARAMETERS
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("messages", [MSGS, LONG_MSGS], ids=["direct", "disaggregated"])
def test_named_tool_choice_returns_a_valid_tool_call(cluster, client, model, messages):
    reply = client.chat.completions.create(
        model=model, messages=messages, **GREEDY, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], "get_weather")


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_returns_valid_tool_calls(cluster, client, model, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = client.chat.completions.create(model=model, messages=MSGS, temperature=0, max_tokens=2 * MAX_TOKENS,
                                           tools=TOOLS, tool_choice="required", **extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (parallel is None or len(calls) == 1)
    for call in calls:
        _check_call(call)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "search"}}, "required"])
def test_streamed_tool_calls_accumulate_in_the_openai_client(cluster, client, model, tool_choice):
    kwargs = dict(model=model, messages=MSGS, temperature=0, max_tokens=2 * MAX_TOKENS, tools=TOOLS,
                  tool_choice=tool_choice)
    with client.chat.completions.stream(**kwargs) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    for call in choice.message.tool_calls:
        _check_call(call, "search" if isinstance(tool_choice, dict) else None)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]  # greedy: the same calls
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content is None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    first_call = next(d.tool_calls[0] for d in deltas if d.tool_calls)
    assert first_call.id and first_call.function.name  # the first delta of a call names it


def test_tool_choice_none_ignores_the_tools(cluster, client, model):
    reply = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


# ---- a worker asked directly (the router refuses such specs first) ----------------------

@pytest.mark.parametrize("pool", ["prefills", "decodes"])
def test_a_worker_answers_a_spec_that_does_not_compile_with_invalid_argument(cluster, pool):
    import grpc

    from pdserve.services.common.grpc_server import channel
    from pdserve.services.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
    sampling = common_pb2.SamplingParams(max_tokens=4, structured_outputs=common_pb2.StructuredOutputs(regex="a(b"))
    worker = getattr(cluster, pool)[0]
    with channel(worker.address) as ch, pytest.raises(grpc.RpcError) as e:
        if pool == "prefills":
            prefill_pb2_grpc.PrefillWorkerStub(ch).Prefill(prefill_pb2.PrefillRequest(
                req_id="bad-spec", prompt_token_ids=[5, 6, 7], sampling=sampling), timeout=60)
        else:
            list(decode_pb2_grpc.DecodeWorkerStub(ch).Decode(decode_pb2.DecodeRequest(
                req_id="bad-spec", prompt_token_ids=[5, 6, 7], sampling=sampling), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("structured_outputs.regex: does not compile")
