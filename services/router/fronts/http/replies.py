"""OpenAI response bodies from the router's messages: a whole response, or one chunk per
message when streaming. Both are built by the same `add`, so streamed deltas concatenate
to exactly the non-streamed text.

    completions  text_completion        choices[i] = {index, text, logprobs, finish_reason}
    chat         chat.completion(.chunk) choices[i] = {index, message|delta, logprobs, finish_reason}
                 (tool calls, when the request forced them: tool_calls.py)

Usage: completion_tokens is the sum over choices of what the router sent; a prompt is
counted once however many choices (n) it has, as OpenAI does, and its cached tokens are
the fewest any of its choices found cached (each choice is its own request on a worker).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

from services.pb import common_pb2
from services.router.fronts.http.logprobs import ChatLogprobs, LegacyLogprobs, TokenText
from services.router.fronts.http.tool_calls import ToolCallReply, tool_call_reply
from services.router.fronts.http.translate import Job


class _Choice:
    def __init__(self, logprobs):
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage = common_pb2.Usage()
        self.logprobs = logprobs  # LegacyLogprobs | ChatLogprobs | None


class Reply(ABC):
    id_prefix: str
    object_whole: str
    object_chunk: str

    def __init__(self, job: Job, model: str, text_of: TokenText):
        self.job = job
        self.model = model
        self.id = f"{self.id_prefix}-{job.req_id}"
        self.created = int(time.time())
        self.choices = [_Choice(None if job.logprobs is None else self._logprobs(text_of)) for _ in job.inputs]

    def add(self, index: int, msg: common_pb2.GenerateResponse) -> dict:
        """Take one message of choice `index`; returns its chunk (for streaming)."""
        choice = self.choices[index]
        choice.text.append(msg.text)
        logprobs = choice.logprobs.add(msg.logprobs) if choice.logprobs is not None else None
        if msg.finish_reason:
            choice.finish_reason = msg.finish_reason
            choice.usage.CopyFrom(msg.usage)
        return self._chunk([self._delta(index, msg.text, logprobs, msg.finish_reason or None)])

    def opening(self) -> list[dict]:
        """Chunks sent before any token (chat: each choice's role)."""
        return []

    def whole(self) -> dict:
        choices = [self._choice(i, "".join(c.text), c.logprobs.whole if c.logprobs else None, c.finish_reason)
                   for i, c in enumerate(self.choices)]
        return dict(self._envelope(self.object_whole, choices), usage=self.usage())

    def usage_chunk(self) -> dict:
        return dict(self._chunk([]), usage=self.usage())

    def usage(self) -> dict:
        prompt: dict[int, int] = {}
        cached: dict[int, int] = {}
        for choice, p in zip(self.choices, self.job.prompt_of):
            prompt[p] = choice.usage.prompt_tokens
            cached[p] = min(cached.get(p, choice.usage.cached_prompt_tokens), choice.usage.cached_prompt_tokens)
        completion = sum(c.usage.completion_tokens for c in self.choices)
        return {"prompt_tokens": sum(prompt.values()), "completion_tokens": completion,
                "total_tokens": sum(prompt.values()) + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _chunk(self, choices: list[dict]) -> dict:
        body = self._envelope(self.object_chunk, choices)
        if self.job.include_usage:  # as OpenAI: then every chunk has "usage", null until the last
            body["usage"] = None
        return body

    @abstractmethod
    def _logprobs(self, text_of: TokenText):
        ...

    @abstractmethod
    def _choice(self, index: int, text: str, logprobs, finish_reason: str | None) -> dict:
        ...

    @abstractmethod
    def _delta(self, index: int, text: str, logprobs, finish_reason: str | None) -> dict:
        ...


class CompletionReply(Reply):
    id_prefix, object_whole, object_chunk = "cmpl", "text_completion", "text_completion"

    def _logprobs(self, text_of):
        return LegacyLogprobs(text_of)

    def _choice(self, index, text, logprobs, finish_reason):
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    _delta = _choice


class ChatReply(Reply):
    id_prefix, object_whole, object_chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, job: Job, model: str, text_of: TokenText):
        super().__init__(job, model, text_of)
        choice = job.tool_choice
        self.tool_calls: list[ToolCallReply] | None = (
            None if choice is None else [tool_call_reply(choice) for _ in job.inputs])

    def _logprobs(self, text_of):
        return ChatLogprobs(text_of)

    def opening(self) -> list[dict]:
        content = "" if self.tool_calls is None else None  # tool calls: no content, as OpenAI streams them
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                              "finish_reason": None}]) for i in range(len(self.choices))]

    def _choice(self, index, text, logprobs, finish_reason):
        message = {"role": "assistant", "content": text}
        if self.tool_calls is not None:
            message, finish_reason = self.tool_calls[index].message(text, finish_reason)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _delta(self, index, text, logprobs, finish_reason):
        delta = {"content": text} if text else {}
        if self.tool_calls is not None:
            whole = "".join(self.choices[index].text)
            delta, finish_reason = self.tool_calls[index].delta(text, whole, finish_reason)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
