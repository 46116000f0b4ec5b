"""The contract of a tool-call parser: a model's own format for tool calls, read out of its
output text (vLLM's --tool-call-parser). Pure functions over text, no tokenizer.

A parser splits the output into content and calls, in order:

    "Let me look. <tool_call>{"name": "search", ...}</tool_call>"
     └ content ──┘└ call ─────────────────────────────────────┘

`split(text, start, ...)` decides what it can of text[start:] and says how far it got:
while streaming (final False) it leaves undecided whatever may still be, or become, part of
a call (a `<tool_call>` that has not closed, even a trailing "<tool_" that may grow into one),
so text shown as content is never taken back. Given the whole output (final True) it decides
everything. Decisions are prefix-stable: deciding a growing output step by step gives the
same segments as deciding it whole, which is what keeps streamed and whole replies equal.

A call the format cannot be sure of is content: JSON that does not parse, a call to a
function not among the request's tools (as SGLang and vLLM's newer parsers treat them),
arguments that are not an object. Never an error: the model wrote text.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field


def call_id() -> str:
    """OpenAI's (and vLLM's) form: call_ and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends arguments
    id: str = field(default_factory=call_id, compare=False)


Segment = str | ToolCall  # content text, or a call


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text outside the calls; None when the calls leave only whitespace
    calls: tuple[ToolCall, ...]


class ToolParser(ABC):
    name: str
    keeps_special_tokens: bool = False  # its markers are special tokens: decode with skip_special_tokens false

    @abstractmethod
    def split(self, text: str, start: int, names: Collection[str] | None,
              final: bool) -> tuple[list[Segment], int]:
        """The segments of text[start:] that are decided, in order, and where the decided part
        ends (text[:start] was decided by earlier calls). `names`: the functions a call may
        name (None: any)."""


def parse_output(parser: ToolParser, text: str, names: Collection[str] | None = None) -> ParsedOutput:
    """A whole output as its content and calls."""
    segments, _ = parser.split(text, 0, names, final=True)
    calls = tuple(s for s in segments if isinstance(s, ToolCall))
    content = "".join(s for s in segments if isinstance(s, str))
    return ParsedOutput(None if calls and not content.strip() else content, calls)


def json_text(obj) -> str:
    """A call's arguments as the JSON text a reply carries, valid JSON and valid UTF-8 whatever
    the model wrote; a number JSON cannot spell (NaN, Infinity) raises ValueError: the text is
    not a JSON call."""
    return without_surrogates(json.dumps(obj, ensure_ascii=False, allow_nan=False))


def without_surrogates(text: str) -> str:
    """UTF-16 surrogates are in a str only when a model wrote them as escapes ("\\ud800" in JSON
    or a Python literal), which the reply's UTF-8 encoder cannot encode (an HTTP 500, an error
    mid-stream). A pair becomes its character (JSON joins pairs, Python literals do not); a
    lone one becomes U+FFFD, as a UTF-8 decoder replaces what it cannot decode."""
    if text.isascii():
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def call_from_json(obj, names: Collection[str] | None) -> ToolCall | None:
    """{"name": N, "arguments" | "parameters": {...}} as a call; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    arguments = {} if arguments is None else arguments
    if not isinstance(arguments, dict):
        return None
    try:
        return ToolCall(without_surrogates(obj["name"]), json_text(arguments))
    except ValueError:  # NaN or Infinity in it
        return None


def skip_space(text: str, at: int = 0) -> int:
    """The index of the first non-whitespace character of text[at:] (len(text): none); no copy."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def held_suffix(text: str, marker: str, start: int) -> int:
    """Where a trailing prefix of `marker` begins in text[start:] (len(text) when none): text
    a stream must hold back, since the next piece may complete the marker."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)
