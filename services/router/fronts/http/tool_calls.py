"""Chat choices whose output holds tool calls, told to the client as OpenAI's
`message.tool_calls` with `finish_reason` "tool_calls" (choice_text.py's contract).

Forced by a grammar (structured.py), `content` null:

    named function:  the output is the arguments object itself
        stream: {"tool_calls": [{"index": 0, "id", "type", "function": {"name", "arguments": piece}}]}
                then {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} for each piece
    "required":      the output is {"name", "arguments"} (or a list of them): the name comes
                     first but a call's end is only known once the whole is parsed, so the calls
                     are sent whole, in the last chunk

An output that did not finish (max_tokens, a stop string) is not a complete call: a named
call keeps its partial arguments (as OpenAI sends them with finish_reason "length"); a
"required" output that does not parse is sent as the plain content it is.

Read by the model's own format (tool_choice "auto", AutoCalls): the tool-call parser splits
the output into content and calls. Content streams as it is decided; each call is sent whole
(id, name and all its arguments in one delta) once the parser has decided it, which for
hermes is when its </tool_call> arrives and for the all-or-nothing formats when the output
ends:

    {"content": "Let me check."}  ...  {"tool_calls": [{"index": 0, "id", "type", "function": {"name", "arguments"}}]}

`finish_reason` is "tool_calls" when the output holds calls and ended by itself ("stop");
"length" stays "length" (the client should know it was cut). With parallel_tool_calls false
only the first call is kept, as vLLM does.
"""
from __future__ import annotations

import json

from pdserve.services.router.fronts.http.choice_text import ChoiceText
from pdserve.services.router.fronts.http.output_parsers import AutoTools
from pdserve.services.router.fronts.http.parsing.stream import ToolCallStream
from pdserve.services.router.fronts.http.parsing.tool_parser import call_id, json_text, parse_output, without_surrogates
from pdserve.services.router.fronts.http.structured import ToolChoice


def _call(index: int, name: str, arguments: str, id_: str | None = None) -> dict:
    return {"index": index, "id": id_ or call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _finish(finish_reason: str | None) -> str | None:
    # the grammar ended the output (the engine says "stop"): the calls are complete
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallReply(ChoiceText):
    """One choice's tool calls: its first delta has no content (as OpenAI streams calls)."""
    opening_content = None


def tool_call_reply(choice: ToolChoice) -> ToolCallReply:
    return NamedCall(choice.name) if choice.name is not None else RequiredCalls(choice.parallel)


class NamedCall(ToolCallReply):
    def __init__(self, name: str):
        self.name = name
        self.id = call_id()
        self.started = False

    def delta(self, piece, text, finish_reason):
        if not piece and (self.started or not finish_reason):
            return {}, _finish(finish_reason)
        call = {"index": 0, "function": {"arguments": piece}}
        if not self.started:  # the first delta names the call
            call = {"index": 0, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": piece}}
            self.started = True
        return {"tool_calls": [call]}, _finish(finish_reason)

    def message(self, text, finish_reason):
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": text}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}, _finish(finish_reason)


class RequiredCalls(ToolCallReply):
    def __init__(self, parallel: bool):
        self.parallel = parallel

    def delta(self, piece, text, finish_reason):
        if not finish_reason:
            return {}, None
        calls = self._calls(text)
        if calls is None:
            return {"content": text}, finish_reason
        return {"tool_calls": calls}, "tool_calls"

    def message(self, text, finish_reason):
        calls = self._calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        for call in calls:
            del call["index"]  # a message's calls have no index; only streamed ones do
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    def _calls(self, text: str) -> list[dict] | None:
        """The calls the output holds; None when it is not a complete one (cut short)."""
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        items = parsed if self.parallel else [parsed]
        if not isinstance(items, list) or not all(_is_call(c) for c in items) or not items:
            return None
        try:
            return [_call(i, without_surrogates(c["name"]), json_text(c["arguments"])) for i, c in enumerate(items)]
        except ValueError:  # NaN or Infinity: not JSON, so not a call
            return None


def _is_call(item) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item


class AutoCalls(ToolCallReply):
    """tool_choice "auto": the calls the model wrote in its own format, and its other text."""

    def __init__(self, auto: AutoTools):
        self.auto = auto
        self.stream = ToolCallStream(auto.parser, auto.names)
        self.num_sent = 0

    def delta(self, piece, text, finish_reason):
        content, calls = self.stream.feed(text, final=finish_reason is not None)
        delta = {"content": content} if content else {}
        if not self.auto.parallel:
            calls = calls[:1 - min(1, self.num_sent)]
        if calls:
            delta["tool_calls"] = [_call(self.num_sent + i, c.name, c.arguments, c.id) for i, c in enumerate(calls)]
            self.num_sent += len(calls)
        return delta, _auto_finish(finish_reason, self.num_sent)

    def message(self, text, finish_reason):
        parsed = parse_output(self.auto.parser, text, self.auto.names)
        calls = parsed.calls if self.auto.parallel else parsed.calls[:1]
        message = {"role": "assistant", "content": parsed.content}
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, _auto_finish(finish_reason, len(calls))


def _auto_finish(finish_reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason
