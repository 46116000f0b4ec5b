"""mistral: Mistral's tool calls, after the special token `[TOOL_CALLS]`, in either of the
forms its tokenizers have used:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}     (v11 and later)

`[TOOL_CALLS]` is a special token, which the detokenizer drops unless it is told to keep them:
the parser says so (keeps_special_tokens) and the chat front then decodes such a request with
skip_special_tokens false, as vLLM's mistral parser adjusts its requests.

Each `[TOOL_CALLS]` stands alone, as a hermes block does: it is decided once its JSON closes
(the array, or the arguments object), so a stream sends its calls then. A marker whose body
is not a complete call to a known function is held until the output ends and is then content,
from the marker up to the next one.
"""
from __future__ import annotations

import json
import re
from collections.abc import Collection

from pdserve.services.router.fronts.http.parsing.tool_parser import (
                                                                     Segment, ToolCall, ToolParser, call_from_json, held_suffix, skip_space)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
_DECODER = json.JSONDecoder()


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def split(self, text: str, start: int, names: Collection[str] | None,
              final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        at = start
        while (opened := text.find(MARKER, at)) >= 0:
            if opened > at:
                segments.append(text[at:opened])
            body = opened + len(MARKER)
            calls, end = _read(text, body, names)
            if calls is None:
                if not final:
                    return segments, opened
                following = text.find(MARKER, body)
                end = len(text) if following < 0 else following
                segments.append(text[opened:end])
            else:
                segments.extend(calls)
            at = end
        held = len(text) if final else held_suffix(text, MARKER, at)
        if held > at:
            segments.append(text[at:held])
        return segments, held


def _read(text: str, at: int, names: Collection[str] | None) -> tuple[list[ToolCall] | None, int]:
    """The calls of one marker's body at text[at:] and where they end; (None, at) when the body
    is not (or not yet) wholly calls to known functions."""
    at = skip_space(text, at)
    try:
        if text.startswith(("[", "{"), at):
            obj, end = _DECODER.raw_decode(text, at)
            calls = [call_from_json(o, names) for o in (obj if isinstance(obj, list) else [obj])]
            return (calls, end) if calls and None not in calls else (None, at)
        name = _NAME.match(text, at)
        if name is None or not text.startswith(ARGS, name.end()):
            return None, at
        args_at = skip_space(text, name.end() + len(ARGS))
        arguments, end = _DECODER.raw_decode(text, args_at)
        call = call_from_json({"name": name.group(), "arguments": arguments}, names)
        return ([call], end) if call is not None else (None, at)
    except (ValueError, RecursionError):
        return None, at
