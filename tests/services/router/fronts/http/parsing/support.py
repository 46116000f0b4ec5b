"""Checks every parser's test uses: a stream fed piece by piece decides what the whole
output decides (the prefix-stability the parsers promise), and never shows as content text
that turns out to be part of a call."""
from __future__ import annotations

from pdserve.services.router.fronts.http.parsing.stream import ToolCallStream
from pdserve.services.router.fronts.http.parsing.tool_parser import ParsedOutput, ToolParser, parse_output


def streamed(parser: ToolParser, text: str, names=None, step: int = 1) -> tuple[str, list, list[int]]:
    """(content sent, calls sent, where in the output each call was sent) feeding `step` characters at a time."""
    stream = ToolCallStream(parser, names)
    content, calls, sent_at = "", [], []
    ends = list(range(step, len(text), step)) + [len(text)]
    for end in ends:
        piece, new = stream.feed(text[:end], final=end == len(text))
        content += piece
        calls += new
        sent_at += [end] * len(new)
    return content, calls, sent_at


def check_stream_matches_whole(parser: ToolParser, text: str, names=None) -> ParsedOutput:
    whole = parse_output(parser, text, names)
    for step in (1, 3, 7, len(text) or 1):
        content, calls, _ = streamed(parser, text, names, step)
        assert content == (whole.content or ""), (step, content, whole)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls], step
    return whole


def pairs(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.calls]
