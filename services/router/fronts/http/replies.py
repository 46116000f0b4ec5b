"""OpenAI response bodies from the router's messages: a whole response, or one chunk per
message when streaming. Both are built by the same `add`, so streamed deltas concatenate
to exactly the non-streamed text.

    completions  text_completion        choices[i] = {index, text, logprobs, finish_reason}
    chat         chat.completion(.chunk) choices[i] = {index, message|delta, logprobs, finish_reason}
                 (what the message holds besides content, tool calls and reasoning: choice_text.py)

prompt_logprobs (vLLM's, when computed and not streamed): completions carry them in each
choice, chat once beside the choices. Completions' echo puts the prompt (and with logprobs
its tokens') before a choice's first message: the first chunk when streaming; chat's echo
puts the last message's content (an assistant's, continued) before the reply's.

return_token_ids (vLLM's): every choice and chunk carries its `token_ids`; the prompt's ids
are `prompt_token_ids`, in each choice (completions) or once beside the choices (chat),
and when streaming in a choice's first chunk (completions) or the first chunk (chat).

Usage: with stream_options.continuous_usage_stats (vLLM's), every chunk carries the usage
so far (usage_so_far); the last chunk the whole usage, as without it.
completion_tokens is the sum over choices of what the router sent; a prompt is
counted once however many choices (n) it has, as OpenAI does, and its cached tokens are
the fewest any of its choices found cached: the first completion's (the prompt is prefilled
once for its n completions, the others read its KV; a completion resumed elsewhere may count more).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from pdserve.services.pb import common_pb2
from pdserve.services.router.fronts.http.choice_text import ChoiceText, PlainText, WithReasoning
from pdserve.services.router.fronts.http.logprobs import (ChatLogprobs, LegacyLogprobs, TokenIdText, TokenText,
                                                          prompt_logprobs_json)
from pdserve.services.router.fronts.http.tool_calls import AutoCalls, tool_call_reply
from pdserve.services.router.fronts.http.translate import Job


class _Choice:
    def __init__(self, logprobs):
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage = common_pb2.Usage()
        self.logprobs = logprobs  # LegacyLogprobs | ChatLogprobs | None
        self.token_ids: list[int] = []  # return_token_ids: what it generated
        self.prompt_logprobs: common_pb2.PromptLogprobs | None = None  # from the first message
        self.started = False  # its first message is in


class Reply(ABC):
    id_prefix: str
    object_whole: str
    object_chunk: str

    def __init__(self, job: Job, model: str, text_of: TokenText, prompt_token_ids: Sequence[Sequence[int]] = ()):
        """`prompt_token_ids`: each prompt, as the router tokenized it (echo shows it)."""
        self.job = job
        self.model = model
        self.id = f"{self.id_prefix}-{job.reply_id or job.req_id}"
        self.created = int(time.time())
        self.text_of = text_of
        self.prompt_token_ids = list(prompt_token_ids)
        shown = TokenIdText() if job.tokens_as_ids else text_of
        self.choices = [_Choice(None if job.logprobs is None else self._logprobs(shown)) for _ in job.prompt_of]

    def add(self, index: int, msg: common_pb2.GenerateResponse) -> dict:
        """Take one message of choice `index`; returns its chunk (for streaming)."""
        choice = self.choices[index]
        choice.started = True
        if msg.HasField("prompt_logprobs"):
            choice.prompt_logprobs = msg.prompt_logprobs
        choice.text.append(msg.text)
        choice.token_ids += msg.token_ids
        logprobs = choice.logprobs.add(msg.logprobs) if choice.logprobs is not None else None
        if msg.finish_reason:
            choice.finish_reason = msg.finish_reason
            choice.usage.CopyFrom(msg.usage)
        delta = self._delta(index, msg.text, logprobs, msg.finish_reason or None)
        if self.job.return_token_ids:
            delta["token_ids"] = list(msg.token_ids)
        return self._chunk([delta])

    def prompt_of(self, index: int) -> list[int]:
        """Choice `index`'s prompt token ids."""
        return list(self.prompt_token_ids[self.job.prompt_of[index]])

    def opening(self) -> list[dict]:
        """Chunks sent before any token (chat: each choice's role)."""
        return []

    def whole(self) -> dict:
        choices = [self._choice(i, "".join(c.text), c.logprobs.whole if c.logprobs else None, c.finish_reason)
                   for i, c in enumerate(self.choices)]
        if self.job.return_token_ids:
            for choice, reply in zip(self.choices, choices):
                reply["token_ids"] = list(choice.token_ids)
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

    def _prompt_logprobs(self, choice: _Choice):
        """vLLM's prompt_logprobs of a choice, when the job computed them."""
        if choice.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(choice.prompt_logprobs, self.text_of)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_so_far(self) -> dict:
        """vLLM's continuous usage: the prompts' tokens (each once) and what was sent so far
        (a finished choice's as its worker counted it)."""
        prompts = {p: len(ids) for p, ids in enumerate(self.prompt_token_ids)}
        completion = 0
        for choice, p in zip(self.choices, self.job.prompt_of):
            if choice.finish_reason:
                prompts[p] = choice.usage.prompt_tokens
                completion += choice.usage.completion_tokens
            else:
                completion += len(choice.token_ids)
        prompt = sum(prompts.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _chunk(self, choices: list[dict]) -> dict:
        body = self._envelope(self.object_chunk, choices)
        if self.job.continuous_usage:
            body["usage"] = self.usage_so_far()
        elif self.job.include_usage:  # as OpenAI: then every chunk has "usage", null until the last
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

    def add(self, index, msg):
        echo = self.job.echo
        first = not self.choices[index].started
        if echo is not None and echo.only:  # max_tokens 0: the one token generated is not shown
            msg = _without_output(msg)
        chunk = self._echoed(index, msg) if echo is not None and first else super().add(index, msg)
        if first and self.job.return_token_ids:
            chunk["choices"][0]["prompt_token_ids"] = self.prompt_of(index)
        return chunk

    def _echoed(self, index: int, msg: common_pb2.GenerateResponse) -> dict:
        """The choice's first chunk, its prompt before it: the text (a token-id prompt decoded)
        and with logprobs the prompt tokens' (from the message's prompt_logprobs)."""
        choice, ids = self.choices[index], self.prompt_of(index)
        text = self.job.echo.texts[self.job.prompt_of[index]]
        text = self.text_of.text(ids) if text is None else text
        choice.text.append(text)
        part = None
        if choice.logprobs is not None:
            part = choice.logprobs.add_prompt(ids, msg.prompt_logprobs, self.job.logprobs)
        chunk = super().add(index, msg)
        delta = chunk["choices"][0]
        delta["text"] = text + delta["text"]
        if part is not None:
            delta["logprobs"] = {key: part[key] + delta["logprobs"][key] for key in part}
        return chunk

    def whole(self) -> dict:
        body = super().whole()
        if self.job.prompt_logprobs:  # vLLM's: in each choice
            for choice, reply in zip(self.choices, body["choices"]):
                reply["prompt_logprobs"] = self._prompt_logprobs(choice)
        if self.job.return_token_ids:
            for i, reply in enumerate(body["choices"]):
                reply["prompt_token_ids"] = self.prompt_of(i)
        return body


class ChatReply(Reply):
    id_prefix, object_whole, object_chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, job: Job, model: str, text_of: TokenText, prompt_token_ids: Sequence[Sequence[int]] = ()):
        super().__init__(job, model, text_of, prompt_token_ids)
        self.texts = [_choice_text(job) for _ in job.prompt_of]
        self.so_far = ["" for _ in job.prompt_of]  # each choice's output text (its parsers read all of it)

    def _logprobs(self, text_of):
        return ChatLogprobs(text_of)

    def opening(self) -> list[dict]:
        chunks = [self._chunk([{"index": i, "delta": {"role": "assistant", "content": t.opening_content},
                                "logprobs": None, "finish_reason": None}]) for i, t in enumerate(self.texts)]
        if self.job.chat_echo:  # vLLM's: one chunk per choice with the echoed content, after the role
            chunks += [self._chunk([{"index": i, "delta": {"content": self.job.chat_echo}, "logprobs": None,
                                     "finish_reason": None}]) for i in range(len(self.texts))]
        if self.job.return_token_ids:
            chunks[0]["prompt_token_ids"] = self.prompt_of(0)
        return chunks

    def _choice(self, index, text, logprobs, finish_reason):
        message, finish_reason = self.texts[index].message(text, finish_reason)
        if not self.job.include_reasoning:
            message.pop("reasoning_content", None)
        if self.job.chat_echo:
            message["content"] = self.job.chat_echo + (message.get("content") or "")
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _delta(self, index, text, logprobs, finish_reason):
        self.so_far[index] += text
        delta, finish_reason = self.texts[index].delta(text, self.so_far[index], finish_reason)
        if not self.job.include_reasoning:
            delta.pop("reasoning_content", None)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self) -> dict:
        body = super().whole()
        if self.job.prompt_logprobs:  # vLLM's: once, beside the choices (every choice has the one prompt)
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        if self.job.return_token_ids:
            body["prompt_token_ids"] = self.prompt_of(0)
        return body


def _choice_text(job: Job) -> ChoiceText:
    """A grammar-forced call, calls read by the tool parser, or plain text; reasoning before it."""
    if job.tool_choice is not None:
        inner = tool_call_reply(job.tool_choice)
    elif job.auto_tools is not None:
        inner = AutoCalls(job.auto_tools)
    else:
        inner = PlainText()
    return inner if job.reasoning is None else WithReasoning(job.reasoning, inner)


def _without_output(msg: common_pb2.GenerateResponse) -> common_pb2.GenerateResponse:
    """The message less its tokens (an echo with max_tokens 0): no text, logprobs or count."""
    out = common_pb2.GenerateResponse()
    out.CopyFrom(msg)
    out.text = ""
    out.ClearField("token_ids")
    out.ClearField("logprobs")
    out.usage.completion_tokens = 0
    return out
