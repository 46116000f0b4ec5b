"""Logprobs in OpenAI's two formats, from the engine's per-token (sampled id, logprob,
top-N {id: logprob}):

    completions (legacy)  {"tokens": [..], "token_logprobs": [..], "top_logprobs": [{token: lp}],
                           "text_offset": [..]}   offsets count from the choice's first character
    chat                  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{..}]}]}

A token's text is the token decoded alone, so a token holding only part of a multi-byte
character shows U+FFFD (its `bytes` are those of that text, not the raw byte piece).
"""
from __future__ import annotations

from collections.abc import Iterable

from services.pb import common_pb2


class TokenText:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text


def _ranked(lp: common_pb2.TokenLogprob) -> list[tuple[int, float]]:
    return sorted(lp.top_logprobs.items(), key=lambda kv: -kv[1])


class LegacyLogprobs:
    """One completion choice's logprobs, built message by message (offsets carry over)."""

    def __init__(self, text_of: TokenText):
        self._text_of = text_of
        self._offset = 0
        self.whole = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, lps: Iterable[common_pb2.TokenLogprob]) -> dict:
        """This message's part, also appended to `whole`."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            token = self._text_of(lp.token_id)
            part["tokens"].append(token)
            part["token_logprobs"].append(lp.logprob)
            part["top_logprobs"].append({self._text_of(t): v for t, v in _ranked(lp)})
            part["text_offset"].append(self._offset)
            self._offset += len(token)
        for key, values in part.items():
            self.whole[key].extend(values)
        return part


class ChatLogprobs:
    """One chat choice's logprobs, built message by message."""

    def __init__(self, text_of: TokenText):
        self._text_of = text_of
        self.whole: dict = {"content": []}

    def add(self, lps: Iterable[common_pb2.TokenLogprob]) -> dict:
        content = [dict(self._entry(lp.token_id, lp.logprob),
                        top_logprobs=[self._entry(t, v) for t, v in _ranked(lp)]) for lp in lps]
        self.whole["content"].extend(content)
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        token = self._text_of(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
