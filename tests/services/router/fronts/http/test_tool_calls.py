"""The chat reply of a tool-call choice, from the router's messages (no workers): whole and
streamed, a complete call and one cut short."""
from __future__ import annotations

import json

from pdserve.engine import SamplingParams
from pdserve.services.pb import common_pb2
from pdserve.services.router.core.request import GenerateInput
from pdserve.services.router.fronts.http.replies import ChatReply
from pdserve.services.router.fronts.http.structured import ToolChoice
from pdserve.services.router.fronts.http.translate import Job

CALLS = [{"name": "search", "arguments": {"query": "x"}}, {"name": "get_weather", "arguments": {"days": 2}}]


def _reply(choice: ToolChoice, pieces: list[str], finish: str) -> tuple[ChatReply, list[dict]]:
    job = Job("r", (GenerateInput("p", SamplingParams()),), (0,), stream=True, include_usage=False, logprobs=None,
              tool_choice=choice)
    reply = ChatReply(job, "m", text_of=None)
    chunks = reply.opening()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunks.append(reply.add(0, common_pb2.GenerateResponse(text=piece, finish_reason=finish if last else "")))
    return reply, [c["choices"][0] for c in chunks]


def test_a_named_call_streams_its_arguments_and_the_whole_message_matches():
    reply, chunks = _reply(ToolChoice("search"), ['{"query"', ': "x"', "}"], "stop")
    assert chunks[0]["delta"] == {"role": "assistant", "content": None}
    first = chunks[1]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "search", "arguments": '{"query"'} and first["id"].startswith("call_")
    assert [c["delta"]["tool_calls"][0] for c in chunks[2:]] == [
        {"index": 0, "function": {"arguments": ': "x"'}}, {"index": 0, "function": {"arguments": "}"}}]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    choice = reply.whole()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [{"id": first["id"], "type": "function",
                                                "function": {"name": "search", "arguments": '{"query": "x"}'}}]


def test_a_named_call_cut_short_keeps_its_partial_arguments_and_length():
    reply, chunks = _reply(ToolChoice("search"), ['{"query"', ': "x'], "length")
    assert chunks[-1]["finish_reason"] == "length"
    choice = reply.whole()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"query": "x'


def test_required_calls_come_whole_in_the_last_chunk():
    text = json.dumps(CALLS)
    reply, chunks = _reply(ToolChoice(None, parallel=True), [text[:10], text[10:]], "stop")
    assert chunks[1]["delta"] == {} and chunks[1]["finish_reason"] is None
    streamed = chunks[-1]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == [
        (0, "search", {"query": "x"}), (1, "get_weather", {"days": 2})]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    message = reply.whole()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["search", "get_weather"]
    assert all("index" not in c for c in message["tool_calls"]) and message["content"] is None


def test_a_single_required_call_is_one_object():
    reply, _ = _reply(ToolChoice(None, parallel=False), [json.dumps(CALLS[0])], "stop")
    calls = reply.whole()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "search"


def test_required_output_that_does_not_parse_is_plain_content():
    text = json.dumps(CALLS)[:-5]
    reply, chunks = _reply(ToolChoice(None, parallel=True), [text], "length")
    assert chunks[-1]["delta"] == {"content": text} and chunks[-1]["finish_reason"] == "length"
    choice = reply.whole()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "length"
