"""What a model writes into a tool call never breaks the reply: a lone surrogate written as an
escape ("\\ud800", which JSON and Python literals decode into a str UTF-8 cannot encode) and a
number JSON cannot spell (NaN) come out as valid JSON in UTF-8, whole and streamed, for every
tool parser and for tool_choice "required". A lone surrogate becomes U+FFFD (as a UTF-8
decoder replaces what it cannot decode); a call with NaN is not a JSON call, so its text is
content. Encoded as the HTTP front encodes them (Starlette's JSONResponse, the SSE lines)."""
from __future__ import annotations

import json

import pytest
from starlette.responses import JSONResponse

from pdserve.engine import SamplingParams
from pdserve.services.pb import common_pb2
from pdserve.services.router.core.request import GenerateInput
from pdserve.services.router.fronts.http.app import _sse
from pdserve.services.router.fronts.http.output_parsers import AutoTools
from pdserve.services.router.fronts.http.parsing import TOOL_PARSERS
from pdserve.services.router.fronts.http.replies import ChatReply
from pdserve.services.router.fronts.http.structured import ToolChoice
from pdserve.services.router.fronts.http.translate import Job

NAMES = frozenset({"get_weather"})
LONE = "\\ud800"  # as the model's text spells it: six characters
PAIR = "\\ud83c\\udf78"  # an escaped pair: one character, U+1F378
CALLS = {  # each parser's call of get_weather with `city` set to the JSON (or Python) value given
    "hermes": '<tool_call>{{"name": "get_weather", "arguments": {{"city": {}}}}}</tool_call>',
    "llama3_json": '{{"name": "get_weather", "parameters": {{"city": {}}}}}',
    "mistral": '[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": {}}}}}]',
    "pythonic": "[get_weather(city={})]",
}


def _run(job: Job, text: str, step: int = 5) -> tuple[dict, list[bytes]]:
    """The whole reply and the stream's SSE lines, both as the front encodes them."""
    reply = ChatReply(job, "m", text_of=None)
    chunks = reply.opening()
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        chunks.append(reply.add(0, common_pb2.GenerateResponse(text=piece, finish_reason="stop" if last else "")))
    whole = json.loads(JSONResponse(reply.whole()).body.decode("utf-8"))
    return whole, [_sse(chunk) for chunk in chunks]


def _auto(parser: str) -> Job:
    return Job("r", (GenerateInput("p", SamplingParams()),), (0,), stream=True, include_usage=False, logprobs=None,
               auto_tools=AutoTools(TOOL_PARSERS[parser], NAMES, True))


def _streamed_arguments(lines: list[bytes]) -> str:
    chunks = [json.loads(line.removeprefix(b"data: ").decode("utf-8")) for line in lines]
    return "".join(call["function"].get("arguments") or "" for c in chunks
                   for call in c["choices"][0]["delta"].get("tool_calls") or [])


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_a_lone_surrogate_in_arguments_becomes_the_replacement_character(parser):
    whole, lines = _run(_auto(parser), CALLS[parser].format(f'"Pa{LONE}ris"'))
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Pa\ufffdris"}
    assert json.loads(_streamed_arguments(lines)) == {"city": "Pa\ufffdris"}


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_an_escaped_pair_stays_its_character(parser):
    whole, _ = _run(_auto(parser), CALLS[parser].format(f'"{PAIR}"'))
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "\U0001f378"}


@pytest.mark.parametrize("parser", sorted(set(CALLS) - {"pythonic"}))  # Python has no NaN literal
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_a_call_with_a_number_json_cannot_spell_is_content_not_a_call(parser, number):
    text = CALLS[parser].format(number)
    whole, lines = _run(_auto(parser), text)
    message = whole["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"] == text
    assert _streamed_arguments(lines) == ""


def test_required_calls_with_a_lone_surrogate_or_nan_stay_json():
    required = Job("r", (GenerateInput("p", SamplingParams()),), (0,), stream=True, include_usage=False,
                   logprobs=None, tool_choice=ToolChoice(None, parallel=True))
    whole, lines = _run(required, f'[{{"name": "get_weather", "arguments": {{"city": "{LONE}"}}}}]')
    [call] = whole["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "\ufffd"}
    assert json.loads(_streamed_arguments(lines)) == {"city": "\ufffd"}
    text = '[{"name": "get_weather", "arguments": {"days": NaN}}]'
    whole, _ = _run(required, text)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_the_control_a_lone_surrogate_left_in_would_fail_both_encoders():
    # what the tests above guard against: the front's encoders cannot encode one (a 500 whole,
    # an error event mid-stream)
    with pytest.raises(UnicodeEncodeError):
        JSONResponse({"arguments": json.loads(f'"{LONE}"')})
    with pytest.raises(UnicodeEncodeError):
        _sse({"arguments": json.loads(f'"{LONE}"')})
