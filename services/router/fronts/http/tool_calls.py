"""A chat choice whose output is tool calls (structured.py forced it with a grammar): told
to the client as OpenAI's `message.tool_calls`, `content` null, `finish_reason` "tool_calls".

    named function:  the output is the arguments object itself
        stream: {"tool_calls": [{"index": 0, "id", "type", "function": {"name", "arguments": piece}}]}
                then {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} for each piece
    "required":      the output is {"name", "arguments"} (or a list of them): the name comes
                     first but a call's end is only known once the whole is parsed, so the calls
                     are sent whole, in the last chunk

An output that did not finish (max_tokens, a stop string) is not a complete call: a named
call keeps its partial arguments (as OpenAI sends them with finish_reason "length"); a
"required" output that does not parse is sent as the plain content it is.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod

from services.router.fronts.http.structured import ToolChoice


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _finish(finish_reason: str | None) -> str | None:
    # the grammar ended the output (the engine says "stop"): the calls are complete
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallReply(ABC):
    """One choice's tool calls, as deltas while streaming and as the whole message."""

    @abstractmethod
    def delta(self, piece: str, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta for one more piece of output (`text`: all of it so far), and the finish reason."""

    @abstractmethod
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole message and its finish reason."""


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
        return [_call(i, c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for i, c in enumerate(items)]


def _is_call(item) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and "arguments" in item
