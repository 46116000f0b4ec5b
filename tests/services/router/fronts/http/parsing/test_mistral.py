"""mistral: [TOOL_CALLS] followed by a JSON array of calls (old tokenizers) or by
name[ARGS]{json} (v11 on), each marker decided on its own."""
from __future__ import annotations

import pytest

from pdserve.services.router.fronts.http.parsing.mistral import MistralParser
from pdserve.services.router.fronts.http.parsing.tool_parser import parse_output
from tests.services.router.fronts.http.parsing.support import check_stream_matches_whole, pairs, streamed

MISTRAL = MistralParser()
NAMES = {"get_weather", "get_time"}
ARRAY = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}'


def test_the_array_form_gives_every_call_in_it():
    parsed = check_stream_matches_whole(MISTRAL, ARRAY, NAMES)
    assert parsed.content is None
    assert pairs(parsed) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_the_v11_form_one_marker_per_call_with_text_before():
    text = f'Checking. {V11}[TOOL_CALLS]get_time[ARGS] {{}}'
    parsed = check_stream_matches_whole(MISTRAL, text, NAMES)
    assert parsed.content == "Checking. "
    assert pairs(parsed) == [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", "{}")]


def test_text_without_the_marker_is_content_as_it_is():
    for text in ("Paris is sunny.", "", "[TOOL_", "a [TOOL_CALLS mention", "[ARGS]{}"):
        parsed = check_stream_matches_whole(MISTRAL, text, NAMES)
        assert parsed.content == text and parsed.calls == ()


@pytest.mark.parametrize("block", [
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": }]',       # not JSON
    '[TOOL_CALLS][{"name": "launch_rockets", "arguments": {}}]',           # not among the tools
    '[TOOL_CALLS][{"name": "get_time"}, {"name": "launch_rockets"}]',      # one bad call spoils its array
    '[TOOL_CALLS]get_weather[ARGS][1, 2]',                                 # arguments not an object
    '[TOOL_CALLS]get weather[ARGS]{}',                                     # not a name
    '[TOOL_CALLS]get_weather{"city": "Paris"}',                            # no [ARGS]
    '[TOOL_CALLS][]',
    '[TOOL_CALLS]' + "[" * 5_000,                                          # too deep for json
])
def test_a_malformed_marker_is_content_up_to_the_next_and_the_others_are_calls(block):
    text = f"{block}{V11}"
    parsed = check_stream_matches_whole(MISTRAL, text, NAMES)
    assert parsed.content == block and pairs(parsed) == [("get_weather", '{"city": "Oslo", "days": 2}')]


def test_an_output_cut_inside_a_call_is_content():
    cut = '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'
    parsed = check_stream_matches_whole(MISTRAL, cut, NAMES)
    assert parsed.content == cut and parsed.calls == ()


def test_text_after_a_closed_call_is_content():
    parsed = check_stream_matches_whole(MISTRAL, f"{V11} and that is all", NAMES)
    assert parsed.content == " and that is all" and len(parsed.calls) == 1


def test_any_name_goes_without_a_list_of_tools():
    assert pairs(parse_output(MISTRAL, '[TOOL_CALLS]anything[ARGS]{"x": "é"}')) == [("anything", '{"x": "é"}')]


def test_a_stream_sends_each_call_when_its_json_closes_and_holds_a_possible_marker():
    text = f"Hi {V11} then {ARRAY}"
    content, calls, sent_at = streamed(MISTRAL, text, NAMES)
    assert content == "Hi  then " and [c.name for c in calls] == ["get_weather", "get_weather", "get_time"]
    assert sent_at == [text.index("}") + 1, len(text), len(text)]
    assert MISTRAL.split("Hi [TOOL_CA", 0, NAMES, final=False) == (["Hi "], 3)
    assert MISTRAL.split('Hi [TOOL_CALLS]get_weather[ARGS]{"ci', 0, NAMES, final=False) == (["Hi "], 3)
