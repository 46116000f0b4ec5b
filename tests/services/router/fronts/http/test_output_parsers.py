"""Which requests the configured parsers read (output_parsers.py), without workers."""
from __future__ import annotations

import logging

import pytest

from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.fronts.http.errors import ApiError
from pdserve.services.router.fronts.http.output_parsers import AUTO_NEEDS, OutputParsers
from pdserve.services.router.fronts.http.schemas import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}, {"type": "function", "function": {"name": "f"}}]
ON = OutputParsers.of(HttpConfig(tool_call_parser="hermes", enable_auto_tool_choice=True))


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_auto_is_the_default_with_tools_and_reads_calls_to_them():
    for body in (_body(tools=TOOLS), _body(tools=TOOLS, tool_choice="auto")):
        auto = ON.auto_tools(body)
        assert auto.parser.name == "hermes" and auto.names == {"get_weather", "f"} and auto.parallel
    assert not ON.auto_tools(_body(tools=TOOLS, parallel_tool_calls=False)).parallel


@pytest.mark.parametrize("fields", [{}, dict(tool_choice="auto"), dict(tools=[], tool_choice="auto"),
                                    dict(tools=TOOLS, tool_choice="none"), dict(tools=TOOLS, tool_choice="required"),
                                    dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})])
def test_other_requests_are_not_parsed(fields):
    assert ON.auto_tools(_body(**fields)) is None
    assert OutputParsers().auto_tools(_body(**fields)) is None  # and need no parser


@pytest.mark.parametrize("cfg", [HttpConfig(), HttpConfig(tool_call_parser="hermes")])
def test_auto_without_auto_tool_choice_is_a_400_naming_tool_choice(cfg):
    with pytest.raises(ApiError) as e:
        OutputParsers.of(cfg).auto_tools(_body(tools=TOOLS))
    assert e.value.status == 400 and e.value.param == "tool_choice" and AUTO_NEEDS in e.value.message


@pytest.mark.parametrize("fields,problem", [
    (dict(tool_call_parser="nope"), "tool_call_parser: 'nope' is not one of hermes, llama3_json, mistral, pythonic"),
    (dict(reasoning_parser="nope"), "reasoning_parser: 'nope' is not one of deepseek_r1, qwen3"),
    (dict(enable_auto_tool_choice=True), "enable_auto_tool_choice: needs a tool_call_parser"),
])
def test_bad_settings_are_refused_naming_them(fields, problem):
    with pytest.raises(ValueError, match="^" + problem):
        HttpConfig(**fields)


def test_a_template_that_never_renders_tools_is_warned_about(caplog):
    class Tokenizer:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with caplog.at_level(logging.WARNING):
        ON.warn_about(Tokenizer())
        OutputParsers().warn_about(Tokenizer())  # no auto tool choice: nothing to say
    assert [r.message for r in caplog.records if "does not render tools" in r.message] and len(caplog.records) == 1
    caplog.clear()
    Tokenizer.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}"
    ON.warn_about(Tokenizer())
    assert not caplog.records
