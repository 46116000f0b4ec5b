"""A tool-call parser over a growing output: what is newly decided at each piece, so that a
stream sends content as soon as it cannot be part of a call and each call once it is whole.

The content rule of parse_output (null when the calls leave only whitespace) is kept by
holding whitespace back until text follows: a stream of only calls sends no content, and
the content a stream sends is exactly the whole output's.

    "<tool_call>{..}</tool_call>\\n<tool_call>{..}</tool_call>"   content: none, 2 calls
    "Sure.\\n<tool_call>{..}</tool_call>"                         content "Sure.\\n", 1 call
"""
from __future__ import annotations

from collections.abc import Collection

from pdserve.services.router.fronts.http.parsing.tool_parser import ToolCall, ToolParser


class ToolCallStream:
    def __init__(self, parser: ToolParser, names: Collection[str] | None = None):
        self.parser, self.names = parser, names
        self.num_calls = 0
        self._decided = 0          # characters of the output decided so far
        self._held = ""            # whitespace-only content not sent yet
        self._sent_text = False    # content with more than whitespace was sent

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """`text`: the whole output so far. The content and calls decided since the last feed."""
        segments, self._decided = self.parser.split(text, self._decided, self.names, final)
        content, calls = [], []
        for segment in segments:
            if isinstance(segment, ToolCall):
                calls.append(segment)
            else:
                content.append(segment)
        self.num_calls += len(calls)
        return self._content("".join(content), final), calls

    def _content(self, piece: str, final: bool) -> str:
        if self._sent_text:
            return piece
        self._held += piece
        if self._held.strip() or (final and not self.num_calls):
            self._sent_text = bool(self._held.strip())
            piece, self._held = self._held, ""
            return piece
        return ""
