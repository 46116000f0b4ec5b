"""Logprobs in OpenAI's two formats, from the engine's per-token (sampled id, logprob,
top-N {id: logprob}):

    completions (legacy)  {"tokens": [..], "token_logprobs": [..], "top_logprobs": [{token: lp}],
                           "text_offset": [..]}   offsets count from the choice's first character
    chat                  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{..}]}]}

A token's text is the token decoded alone, so a token holding only part of a multi-byte
character shows U+FFFD (its `bytes` are those of that text, not the raw byte piece); with
vLLM's return_tokens_as_token_ids it is "token_id:N" (TokenIdText).

The prompt's logprobs (prompt_logprobs, from the first message) come in vLLM's form,
[null, {"id": {"logprob", "rank", "decoded_token"}}, ...], and echoed in the legacy format
before the output's, the first prompt token's logprob null.
"""
from __future__ import annotations

from collections.abc import Iterable

from pdserve.services.pb import common_pb2


class TokenText:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id])
        return text

    def text(self, token_ids) -> str:
        """A token-id prompt as text (an echo), special tokens included, as vLLM decodes it."""
        return self._tokenizer.decode(list(token_ids))


class TokenIdText:
    """vLLM's return_tokens_as_token_ids: a token shown by its id, for tokens no text can show."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


_FLOOR = -9999.0  # vLLM's (and OpenAI's) stand-in for -inf, which JSON cannot carry


def prompt_logprobs_json(plp: common_pb2.PromptLogprobs, text_of: TokenText) -> list:
    """vLLM's prompt_logprobs: per prompt token {token id: {logprob, rank, decoded_token}},
    the prompt token's first, then the top N of its position; the first token's is null."""
    out: list = [None]
    for lp, rank in zip(plp.tokens, plp.ranks):
        entry = {str(lp.token_id): _logprob_json(lp.logprob, rank, text_of(lp.token_id))}
        for j, (t, v) in enumerate(_ranked(lp)):
            entry.setdefault(str(t), _logprob_json(v, j + 1, text_of(t)))
        out.append(entry)
    return out


def _logprob_json(logprob: float, rank: int, token: str) -> dict:
    return {"logprob": max(logprob, _FLOOR), "rank": rank, "decoded_token": token}


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

    def add_prompt(self, prompt_token_ids, plp: common_pb2.PromptLogprobs, top_n: int) -> dict:
        """An echoed prompt's part (before the output's): the first token's logprob and top
        null, then each prompt token's with the top `top_n` of its position."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        rows = [None] + list(plp.tokens)
        for token_id, lp in zip(prompt_token_ids, rows):
            token = self._text_of(token_id)
            part["tokens"].append(token)
            part["token_logprobs"].append(None if lp is None else max(lp.logprob, _FLOOR))
            part["top_logprobs"].append(None if lp is None else {self._text_of(t): max(v, _FLOOR)
                                                                 for t, v in _ranked(lp)[:top_n]})
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
