"""An agent's tool conversation through the router's HTTP API, driven by the official openai
client: tool_choice "auto" (its default), whole and streamed, two turns. The decode worker is
scripted (tests/services/router/fakes.py's, answering a set text): a random model never writes
a tool call, so this is where the output is known; the prompt it was sent is checked against
transformers' own rendering of the conversation with its tools."""
from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from pdserve.engine.chat import load_chat_template, with_chat_template
from pdserve.services.common.grpc_server import ServiceSpec, start_server
from pdserve.services.pb import common_pb2, decode_pb2_grpc, kvstore_pb2_grpc
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.fronts.http.output_parsers import AUTO_NEEDS
from pdserve.services.router.server import serve
from tests.services.router.fakes import FakeDecode, FakeKVStore
from tests.services.router.fronts.http.support import sync_client

TEMPLATE = str(Path(__file__).parents[5] / "examples" / "tool_chat_template_hermes.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedDecode(FakeDecode):
    """Answers each Decode with the next scripted text, a few characters a message, then "stop"."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []

    def Decode(self, request, context):
        self.requests.append(request)
        text = self.scripts.pop(0)
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        for i, piece in enumerate(pieces):
            msg = common_pb2.GenerateResponse(req_id=request.req_id, token_ids=[1000 + i], text=piece)
            if i == len(pieces) - 1:
                msg.finish_reason = "stop"
                msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                    completion_tokens=len(pieces)))
            yield msg


@pytest.fixture(scope="module")
def workers():
    decode, kvstore = ScriptedDecode(), FakeKVStore()
    servers = [start_server([ServiceSpec("pdserve.v1.DecodeWorker", decode_pb2_grpc.add_DecodeWorkerServicer_to_server,
                                         decode)]),
               start_server([ServiceSpec("pdserve.v1.KVStore", kvstore_pb2_grpc.add_KVStoreServicer_to_server,
                                         kvstore)])]
    yield decode, [f"127.0.0.1:{s.port}" for s in servers]
    for server in servers:
        server.stop(grace=0)


def _router(workers, tiny_llama_dir, tokenizer, **http):
    _, (decode, kvstore) = workers
    cfg = RouterConfig(model=tiny_llama_dir, decode_addresses=(decode,), kvstore_address=kvstore, port=0,
                       metrics_port=None, chat_template=TEMPLATE)  # colocated: every prompt to the decode
    return serve(cfg, tokenizer=tokenizer, http=HttpConfig(port=0, **http))


@pytest.fixture(scope="module")
def agent_router(workers, tiny_llama_dir, tiny):
    router = _router(workers, tiny_llama_dir, tiny.tokenizer, tool_call_parser="hermes",
                     enable_auto_tool_choice=True, reasoning_parser="qwen3")
    yield router
    router.stop(grace_s=0)


@pytest.fixture(scope="module")
def plain_router(workers, tiny_llama_dir, tiny):
    router = _router(workers, tiny_llama_dir, tiny.tokenizer)
    yield router
    router.stop(grace_s=0)


@pytest.fixture
def decode(workers):
    decode = workers[0]
    decode.scripts.clear()
    yield decode
    assert decode.scripts == []  # every scripted answer was asked for


@pytest.fixture
def client(agent_router):
    with sync_client(agent_router) as c:
        yield c


@pytest.fixture(scope="module")
def rendering(tiny):
    """The prompt transformers makes of a conversation (HF form: arguments as objects) and tools."""
    tokenizer = with_chat_template(tiny.tokenizer, load_chat_template(TEMPLATE))
    return lambda messages: list(tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                               return_dict=False))


def _hf_form(message) -> dict:
    """An assistant message of the reply, as an HF chat template takes it."""
    return {"role": "assistant", "content": message.content or "", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                      "arguments": json.loads(c.function.arguments)}}
        for c in message.tool_calls]}


def test_a_two_turn_tool_conversation(client, decode, rendering, agent_router):
    model = agent_router.servicer.model.name
    decode.scripts += [f"Let me look that up.\n{CALL}", "It is 18 C in Paris."]
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS)  # tool_choice: "auto"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look that up.\n"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert list(decode.requests[-1].prompt_token_ids) == rendering(ASK)  # the tools reached the model

    messages = ASK + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "It is 18 C in Paris."
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    turn_two = ASK + [_hf_form(choice.message), {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    assert list(decode.requests[-1].prompt_token_ids) == rendering(turn_two)
    assert "<tool_response>\n18 C\n</tool_response>" in agent_router.servicer.front.validator.tokenizer.decode(
        decode.requests[-1].prompt_token_ids)


def test_streamed_calls_accumulate_in_the_client(client, decode, agent_router):
    model = agent_router.servicer.model.name
    oslo = CALL.replace("Paris", "Oslo")
    decode.scripts += [f"Checking both.\n{CALL}\n{oslo}"] * 2
    with client.chat.completions.stream(model=model, messages=ASK, tools=TOOLS) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    whole = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS).choices[0]
    streamed = final.choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert streamed.message.content == whole.message.content == "Checking both.\n\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert [c.index for c in calls] == [0, 1] and all(c.id.startswith("call_") and c.type == "function"
                                                      for c in calls)
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_call]) == "Checking both.\n"  # text came first


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',    # malformed
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',          # not among the tools
    "Paris is sunny <tool_",
])
def test_what_does_not_parse_comes_back_as_text(client, decode, agent_router, stream, text):
    decode.scripts.append(text)
    kwargs = dict(model=agent_router.servicer.model.name, messages=ASK, tools=TOOLS)
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            choice = s.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_apart_from_the_call(client, decode, agent_router, stream):
    decode.scripts.append(f"<think>The user asks about Paris.</think>\n{CALL}")
    kwargs = dict(model=agent_router.servicer.model.name, messages=ASK, tools=TOOLS)
    if stream:
        with client.chat.completions.stream(**kwargs) as s:
            chunks = [e.chunk for e in s if e.type == "chunk"]
            message = s.get_final_completion().choices[0].message
        assert any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "The user asks about Paris."
    assert not message.content and message.tool_calls[0].function.name == "get_weather"


def test_tool_choice_none_renders_the_tools_and_parses_nothing(client, decode, agent_router, rendering):
    decode.scripts.append(CALL)
    reply = client.chat.completions.create(model=agent_router.servicer.model.name, messages=ASK, tools=TOOLS,
                                           tool_choice="none")
    assert reply.choices[0].message.content == CALL and not reply.choices[0].message.tool_calls
    assert list(decode.requests[-1].prompt_token_ids) == rendering(ASK)


@pytest.mark.parametrize("kwargs", [dict(tools=TOOLS), dict(tools=TOOLS, tool_choice="auto")])
def test_without_auto_tool_choice_auto_is_refused_naming_tool_choice(plain_router, decode, kwargs):
    with sync_client(plain_router) as c, pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=plain_router.servicer.model.name, messages=ASK, **kwargs)
    assert e.value.param == "tool_choice" and AUTO_NEEDS in e.value.message


def test_an_assistant_tool_call_with_arguments_that_are_not_json_is_refused(client, decode, agent_router):
    bad = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=agent_router.servicer.model.name, messages=ASK + [bad], tools=TOOLS)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


@pytest.fixture(scope="module")
def mistral_router(workers, tiny_llama_dir, tiny):
    router = _router(workers, tiny_llama_dir, tiny.tokenizer, tool_call_parser="mistral", enable_auto_tool_choice=True)
    yield router
    router.stop(grace_s=0)


def test_mistral_calls_are_read_and_its_marker_is_decoded_as_the_special_token_it_is(mistral_router, decode):
    """[TOOL_CALLS] is a special token: with tools the worker is told to keep special tokens in
    the text (else the parser would never see the marker); a request that sets the field keeps
    its own value, one without tools the default."""
    model = mistral_router.servicer.model.name
    decode.scripts += ['[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Plain.", "Kept."]
    with sync_client(mistral_router) as client:
        [call] = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS).choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert decode.requests[-1].sampling.skip_special_tokens is False
        client.chat.completions.create(model=model, messages=ASK)
        assert decode.requests[-1].sampling.skip_special_tokens is True
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, extra_body={"skip_special_tokens": True})
        assert decode.requests[-1].sampling.skip_special_tokens is True
