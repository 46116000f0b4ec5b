"""llama3_json: Llama 3.1/3.2's JSON tool calls. The output opens with the call (after the
optional `<|python_tag|>`, which the engine's detokenizer drops as a special token): one
JSON object, or several separated by ";":

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

("arguments" is read as well as "parameters"). All or nothing: an output that opens like a
call but is not wholly calls to known functions is content, so a stream holds such an output
until it ends. One that opens with anything else is content from its first character.
"""
from __future__ import annotations

import json
from collections.abc import Collection

from pdserve.services.router.fronts.http.parsing.tool_parser import Segment, ToolCall, ToolParser, call_from_json, skip_space

TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def split(self, text: str, start: int, names: Collection[str] | None,
              final: bool) -> tuple[list[Segment], int]:
        if start > 0:  # decided before: the output did not open with a call
            return [text[start:]], len(text)
        at = skip_space(text)
        if text.startswith(TAG, at):
            at = skip_space(text, at + len(TAG))
        elif not final and len(text) - at < len(TAG) and TAG.startswith(text[at:]):
            return [], 0  # may be the tag, still arriving
        if not final and (at == len(text) or text.startswith("{", at)):
            return [], 0  # a call may be coming: hold everything
        calls = _calls(text[at:], names) if text.startswith("{", at) else None
        return (list(calls) if calls else [text]), len(text)


def _calls(body: str, names: Collection[str] | None) -> list[ToolCall] | None:
    calls, at = [], 0
    try:
        while True:
            obj, at = _DECODER.raw_decode(body, at)
            call = call_from_json(obj, names)
            if call is None:
                return None
            calls.append(call)
            rest = body[at:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return None
            rest = rest[1:].lstrip()
            if not rest:  # a trailing ";"
                return calls
            at = len(body) - len(rest)
    except (ValueError, RecursionError):
        return None
