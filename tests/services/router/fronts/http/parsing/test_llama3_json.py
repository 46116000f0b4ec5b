"""llama3_json: the output opens with JSON call objects, separated by ";"; all or nothing."""
from __future__ import annotations

import pytest

from pdserve.services.router.fronts.http.parsing.llama3_json import Llama3JsonParser
from tests.services.router.fronts.http.parsing.support import check_stream_matches_whole, pairs, streamed

LLAMA = Llama3JsonParser()
NAMES = {"get_weather", "get_time"}


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '\n {"name": "get_weather", "arguments": {"city": "Paris"}}\n',
])
def test_one_call(text):
    parsed = check_stream_matches_whole(LLAMA, text, NAMES)
    assert parsed.content is None and pairs(parsed) == [("get_weather", '{"city": "Paris"}')]


def test_several_calls_separated_by_semicolons():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}};'
    parsed = check_stream_matches_whole(LLAMA, text, NAMES)
    assert pairs(parsed) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text',  # not only calls
    '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "launch", "parameters": {}}',  # unknown
    '{"name": "get_weather", "parameters": {"city": ',                                # cut short
    '{"answer": 42}',                                                                 # JSON, not a call
    'Here: {"name": "get_weather", "parameters": {}}',                                # not at the start
    "",
])
def test_anything_but_whole_calls_is_content(text):
    parsed = check_stream_matches_whole(LLAMA, text, NAMES)
    assert parsed.content == text and parsed.calls == ()


def test_a_stream_sends_text_at_once_but_holds_a_possible_call_until_the_end():
    content, _, _ = streamed(LLAMA, "Sunny.", NAMES)
    assert content == "Sunny."
    assert LLAMA.split("Sun", 0, NAMES, final=False) == (["Sun"], 3)
    assert LLAMA.split('{"name"', 0, NAMES, final=False) == ([], 0)
    assert LLAMA.split("<|python", 0, NAMES, final=False) == ([], 0)
    text = '{"name": "get_time", "parameters": {}}'
    _, calls, sent_at = streamed(LLAMA, text, NAMES)
    assert [c.name for c in calls] == ["get_time"] and sent_at == [len(text)]
