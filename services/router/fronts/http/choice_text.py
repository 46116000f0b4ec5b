"""One chat choice's output text as OpenAI's message fields: deltas while streaming, the
whole message at the end. A contract with three kinds behind it, chosen per request:

    PlainText      content as the engine wrote it (no tools, or tool_choice "none")
    NamedCall, RequiredCalls, AutoCalls (tool_calls.py)   the output holds tool calls
    WithReasoning  a reasoning parser first: the thinking to `reasoning_content`, the rest
                   to one of the above

Streamed deltas and the whole message come from the same decisions, so the deltas
accumulate (as OpenAI's client does it) to the whole message.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.services.router.fronts.http.parsing.reasoning import ReasoningParser, ReasoningStream


class ChoiceText(ABC):
    opening_content: str | None = ""  # the content of the first delta, beside the role

    @abstractmethod
    def delta(self, piece: str, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta for one more piece of output (`text`: all of it so far), and the finish reason."""

    @abstractmethod
    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole message and its finish reason."""


class PlainText(ChoiceText):
    def delta(self, piece, text, finish_reason):
        return ({"content": piece} if piece else {}), finish_reason

    def message(self, text, finish_reason):
        return {"role": "assistant", "content": text}, finish_reason


class WithReasoning(ChoiceText):
    """`reasoning_content` (vLLM's field) beside what `inner` makes of the rest."""

    def __init__(self, parser: ReasoningParser, inner: ChoiceText):
        self.parser, self.inner = parser, inner
        self.stream = ReasoningStream(parser)
        self.content = ""
        self.opening_content = inner.opening_content

    def delta(self, piece, text, finish_reason):
        reasoning, content = self.stream.feed(text, final=finish_reason is not None)
        self.content += content
        delta, finish_reason = self.inner.delta(content, self.content, finish_reason)
        return ({"reasoning_content": reasoning, **delta} if reasoning else delta), finish_reason

    def message(self, text, finish_reason):
        reasoning, content = self.parser.split(text)
        message, finish_reason = self.inner.message(content or "", finish_reason)
        if message.get("content") == "":
            message["content"] = None  # all of it was thinking
        return dict(message, reasoning_content=reasoning), finish_reason
