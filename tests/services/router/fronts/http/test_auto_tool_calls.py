"""The chat reply of tool_choice "auto" and of a reasoning parser, from the router's messages
(no workers): content and calls, whole and streamed, in OpenAI's shapes."""
from __future__ import annotations

import json

from pdserve.engine import SamplingParams
from pdserve.services.pb import common_pb2
from pdserve.services.router.core.request import GenerateInput
from pdserve.services.router.fronts.http.output_parsers import AutoTools
from pdserve.services.router.fronts.http.parsing import REASONING_PARSERS, TOOL_PARSERS
from pdserve.services.router.fronts.http.replies import ChatReply
from pdserve.services.router.fronts.http.translate import Job

NAMES = frozenset({"get_weather", "get_time"})
PARIS = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def _reply(text: str, finish: str = "stop", parallel: bool = True, reasoning: str | None = None,
           step: int = 4, parser: str = "hermes") -> tuple[ChatReply, list[dict]]:
    job = Job("r", (GenerateInput("p", SamplingParams()),), (0,), stream=True, include_usage=False, logprobs=None,
              auto_tools=AutoTools(TOOL_PARSERS[parser], NAMES, parallel),
              reasoning=REASONING_PARSERS.get(reasoning))
    reply = ChatReply(job, "m", text_of=None)
    chunks = reply.opening()
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunks.append(reply.add(0, common_pb2.GenerateResponse(text=piece, finish_reason=finish if last else "")))
    return reply, [c["choices"][0] for c in chunks]


def _accumulated(chunks: list[dict]) -> dict:
    """The message as OpenAI's client accumulates a stream's deltas."""
    from openai.lib.streaming._deltas import accumulate_delta
    message: dict = {}
    for chunk in chunks:
        message = accumulate_delta(message, json.loads(json.dumps(chunk["delta"])))
    for call in message.get("tool_calls") or []:
        call.pop("index")
    return message


def test_text_then_a_call_whole_and_streamed():
    reply, chunks = _reply(f"Let me check.\n{PARIS}")
    choice = reply.whole()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check.\n"
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chunks[0]["delta"] == {"role": "assistant", "content": None}
    streamed_calls = [c["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["delta"]]
    assert len(streamed_calls) == 1  # sent whole, once its block closed
    assert streamed_calls[0][0]["index"] == 0 and streamed_calls[0][0]["function"]["name"] == "get_weather"
    assert chunks[-1]["finish_reason"] == "tool_calls"
    streamed = _accumulated(chunks)
    assert streamed["content"] == message["content"]
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in message["tool_calls"]]


def test_two_calls_take_indices_and_no_content():
    reply, chunks = _reply(f"{PARIS}\n{TIME}")
    message = reply.whole()["choices"][0]["message"]
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_weather", "get_time"]
    indices = [call["index"] for c in chunks for call in c["delta"].get("tool_calls", [])]
    assert indices == [0, 1]
    assert _accumulated(chunks).get("content") is None


def test_without_parallel_tool_calls_only_the_first_is_kept():
    reply, chunks = _reply(f"{PARIS}{TIME}", parallel=False)
    assert [c["function"]["name"] for c in reply.whole()["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    assert [call["function"]["name"] for c in chunks for call in c["delta"].get("tool_calls", [])] == ["get_weather"]


def test_plain_text_is_content_with_its_finish_reason():
    for finish in ("stop", "length"):
        reply, chunks = _reply("It is sunny in Paris.", finish)
        choice = reply.whole()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
        assert choice["finish_reason"] == finish and chunks[-1]["finish_reason"] == finish
        assert _accumulated(chunks) == {"role": "assistant", "content": "It is sunny in Paris."}


def test_a_malformed_call_is_content_never_an_error():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
    reply, chunks = _reply(text)
    choice = reply.whole()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "stop"
    assert _accumulated(chunks)["content"] == text


def test_a_call_cut_short_by_length_keeps_length():
    reply, _ = _reply(f"{PARIS}<tool_call>" + '{"name": "get_ti', "length")
    choice = reply.whole()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1


def test_other_formats_stream_their_calls_at_the_end():
    text = '[get_weather(city="Paris"), get_time()]'
    reply, chunks = _reply(text, parser="pythonic")
    assert [c["function"]["name"] for c in reply.whole()["choices"][0]["message"]["tool_calls"]] == [
        "get_weather", "get_time"]
    with_calls = [i for i, c in enumerate(chunks) if "tool_calls" in c["delta"]]
    assert with_calls == [len(chunks) - 1]


def test_reasoning_goes_to_reasoning_content_and_the_rest_to_the_tool_parser():
    text = f"<think>The user wants Paris.</think>\n{PARIS}"
    reply, chunks = _reply(text, reasoning="qwen3")
    message = reply.whole()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants Paris." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    streamed = _accumulated(chunks)
    assert streamed["reasoning_content"] == "The user wants Paris." and streamed.get("content") is None
    assert "".join(c["delta"].get("reasoning_content", "") for c in chunks) == "The user wants Paris."


def test_reasoning_without_tools():
    job = Job("r", (GenerateInput("p", SamplingParams()),), (0,), stream=True, include_usage=False, logprobs=None,
              reasoning=REASONING_PARSERS["deepseek_r1"])
    reply = ChatReply(job, "m", text_of=None)
    chunks = reply.opening() + [reply.add(0, common_pb2.GenerateResponse(text=t, finish_reason=f)) for t, f in
                                [("Hmm, Par", ""), ("is.</th", ""), ("ink>\n\nParis.", "stop")]]
    message = reply.whole()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "\n\nParis.", "reasoning_content": "Hmm, Paris."}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert deltas == [{"reasoning_content": "Hmm, Par"}, {"reasoning_content": "is."}, {"content": "\n\nParis."}]
