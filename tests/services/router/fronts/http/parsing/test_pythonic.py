"""pythonic: [f(a=1), g()] read with ast, never evaluated; all or nothing."""
from __future__ import annotations

import json

import pytest

from pdserve.services.router.fronts.http.parsing.pythonic import PythonicParser
from tests.services.router.fronts.http.parsing.support import check_stream_matches_whole, pairs

PYTHONIC = PythonicParser()
NAMES = {"get_weather", "get_time"}


def test_several_calls_with_literal_arguments():
    text = '[get_weather(city="Paris", days=2, units=["C"], opts={"rain": True}, x=None), get_time()]'
    parsed = check_stream_matches_whole(PYTHONIC, text, NAMES)
    assert parsed.content is None
    assert [(n, json.loads(a)) for n, a in pairs(parsed)] == [
        ("get_weather", {"city": "Paris", "days": 2, "units": ["C"], "opts": {"rain": True}, "x": None}),
        ("get_time", {})]


def test_json_literals_are_read_too():
    parsed = check_stream_matches_whole(PYTHONIC, " [get_time(utc=true, tz=null, dst=false)]\n", NAMES)
    assert pairs(parsed) == [("get_time", '{"utc": true, "tz": null, "dst": false}')]


@pytest.mark.parametrize("text", [
    "It is sunny in Paris.",
    "[get_weather(city=__import__('os').system('true'))]",  # not a literal: never run
    '[get_weather("Paris")]',                               # positional
    "[get_weather(**{'city': 'Paris'})]",
    "[launch_rockets()]",                                   # not among the tools
    "[os.system('ls')]",                                    # dotted
    '[get_weather(city="Paris"), ]x',                       # syntax
    '[get_weather(city="Par',                               # cut short
    "[get_weather(city={1, 2})]",                           # a set: no JSON
    "[get_weather(city=1e999)]",                            # inf: no JSON
    "[get_weather(city=1, city=2)]",                        # repeated keyword
    "[]",
    "[1, 2]",
    "[" * 10_000 + "]" * 10_000,                            # too deep for the parser
])
def test_anything_but_whole_calls_is_content(text):
    parsed = check_stream_matches_whole(PYTHONIC, text, NAMES)
    assert parsed.content == text and parsed.calls == ()


def test_a_stream_holds_an_output_that_opens_with_a_bracket():
    assert PYTHONIC.split("[get_ti", 0, NAMES, final=False) == ([], 0)
    assert PYTHONIC.split("Sunny", 0, NAMES, final=False) == (["Sunny"], 5)
    assert PYTHONIC.split("Sunny [", 5, NAMES, final=False) == ([" ["], 7)
