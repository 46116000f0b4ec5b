"""hermes: <tool_call>{json}</tool_call> blocks anywhere, each decided on its own."""
from __future__ import annotations

import pytest

from pdserve.services.router.fronts.http.parsing.hermes import HermesParser
from pdserve.services.router.fronts.http.parsing.tool_parser import parse_output
from tests.services.router.fronts.http.parsing.support import check_stream_matches_whole, pairs, streamed

HERMES = HermesParser()
NAMES = {"get_weather", "get_time"}
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OSLO = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'


def test_one_call_and_no_content():
    parsed = check_stream_matches_whole(HERMES, PARIS, NAMES)
    assert parsed.content is None and pairs(parsed) == [("get_weather", '{"city": "Paris"}')]
    assert parsed.calls[0].id.startswith("call_") and len(parsed.calls[0].id) == 29


def test_several_calls_with_text_around_them():
    text = f"I'll check both.\n{PARIS}\n{OSLO}\nDone."
    parsed = check_stream_matches_whole(HERMES, text, NAMES)
    assert parsed.content == "I'll check both.\n\n\nDone."
    assert pairs(parsed) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo", "days": 2}')]
    assert len({c.id for c in parsed.calls}) == 2


def test_only_whitespace_between_calls_is_no_content():
    parsed = check_stream_matches_whole(HERMES, f"\n{PARIS}\n\n{OSLO}\n", NAMES)
    assert parsed.content is None and len(parsed.calls) == 2


def test_text_without_calls_is_content_as_it_is():
    for text in ("Paris is sunny.", "  ", "", "a <tool_ tag that never opens", "x </tool_call> y"):
        parsed = check_stream_matches_whole(HERMES, text, NAMES)
        assert parsed.content == text and parsed.calls == ()


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',   # not JSON
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',         # not among the tools
    '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',                    # no name
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',        # arguments not an object
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>' + "[" * 5_000 + '</tool_call>',                               # too deep for json
])
def test_a_malformed_block_stays_content_and_the_others_are_calls(block):
    text = f"{block}\n{OSLO}"
    parsed = check_stream_matches_whole(HERMES, text, NAMES)
    assert parsed.content == block + "\n" and pairs(parsed) == [("get_weather", '{"city": "Oslo", "days": 2}')]


def test_any_name_goes_without_a_list_of_tools():
    assert pairs(parse_output(HERMES, '<tool_call>{"name": "anything"}</tool_call>')) == [("anything", "{}")]


def test_arguments_given_as_json_text_or_as_parameters_are_read():
    text = ('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
            '<tool_call>{"name": "get_time", "parameters": {"tz": "CET"}}</tool_call>')
    assert pairs(parse_output(HERMES, text, NAMES)) == [("get_time", '{"tz": "UTC"}'), ("get_time", '{"tz": "CET"}')]


def test_non_ascii_arguments_stay_readable():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    assert pairs(parse_output(HERMES, text, NAMES)) == [("get_weather", '{"city": "Zürich"}')]


def test_a_block_left_open_at_the_end_is_read_as_vllm_does():
    parsed = check_stream_matches_whole(HERMES, 'Sure <tool_call>{"name": "get_time", "arguments": {}}', NAMES)
    assert parsed.content == "Sure " and pairs(parsed) == [("get_time", "{}")]
    cut = check_stream_matches_whole(HERMES, 'Sure <tool_call>{"name": "get_ti', NAMES)
    assert cut.content == 'Sure <tool_call>{"name": "get_ti' and cut.calls == ()


def test_a_stream_sends_each_call_when_its_block_closes_and_holds_a_possible_tag():
    text = f"Hi {PARIS} then {OSLO}"
    content, calls, sent_at = streamed(HERMES, text, NAMES)
    assert content == "Hi  then " and [c.name for c in calls] == ["get_weather"] * 2
    assert sent_at == [text.index("</tool_call>") + len("</tool_call>"), len(text)]
    # "<tool_" may still become a tag: held back, never shown and taken back
    segments, decided = HERMES.split("Hi <tool_", 0, NAMES, final=False)
    assert segments == ["Hi "] and decided == 3
    assert HERMES.split("Hi <tool_call>{", 0, NAMES, final=False) == (["Hi "], 3)
