"""hermes: Hermes 2/3, Qwen2.5/Qwen3 and the models trained on their format. Each call is a
JSON object in its own tags, anywhere in the output, as many as the model writes:

    I'll check both.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>

Each block stands alone: one that does not parse (or names an unknown function) stays in
the content as the text it is, the others are still calls; so a block is decided as soon as
it closes, and a stream sends each call then. A block still open when the output ends (the
model stopped before `</tool_call>`) is read the same way, as vLLM does.
"""
from __future__ import annotations

import json
from collections.abc import Collection

from pdserve.services.router.fronts.http.parsing.tool_parser import Segment, ToolParser, call_from_json, held_suffix

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def split(self, text: str, start: int, names: Collection[str] | None,
              final: bool) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        at = start
        while (opened := text.find(START, at)) >= 0:
            if opened > at:
                segments.append(text[at:opened])
            closed = text.find(END, opened)
            if closed < 0 and not final:
                return segments, opened
            end = len(text) if closed < 0 else closed + len(END)
            call = _call(text[opened + len(START):closed if closed >= 0 else len(text)], names)
            segments.append(call if call is not None else text[opened:end])
            at = end
        held = len(text) if final else held_suffix(text, START, at)
        if held > at:
            segments.append(text[at:held])
        return segments, held


def _call(body: str, names: Collection[str] | None):
    try:
        return call_from_json(json.loads(body), names)
    except (ValueError, RecursionError):
        return None
