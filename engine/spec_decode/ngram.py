"""Prompt lookup decoding (vLLM's method "ngram"): guess that the text continues the way it
did the last time the same few tokens appeared. It needs no model, and on outputs that copy
spans of their prompt (code edits, extraction, quoting) most guesses are right.

For each request, the last n tokens (the suffix) are looked up in the earlier tokens, for n
from prompt_lookup_max down to prompt_lookup_min; the longest n that occurs wins, and among
its occurrences the most recent. The tokens that followed that occurrence are the drafts:

    tokens:  a b c d x y a b c d e f a b c
                                     └─┬─┘ suffix (n = 3)
                   └─┬─┘ ◀── most recent earlier occurrence of "a b c"
                         d e f ...   drafts: what followed it (at most k)

The suffix itself is never a match: an occurrence must end before the last token. A
continuation that reaches the end of the sequence wraps around (see `lookup`).
"""
from __future__ import annotations

import numpy as np

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.spec_decode.proposer import DraftRequest, Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"speculative_config.{name}", f"must be an integer >= 1, got {value!r}")
        if prompt_lookup_min > prompt_lookup_max:
            raise InvalidRequestError("speculative_config.prompt_lookup_min",
                                      f"must be <= prompt_lookup_max, got {prompt_lookup_min} > {prompt_lookup_max}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._buffers: dict[str, _TokenBuffer] = {}

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for r in requests:
            tokens = self._buffers.setdefault(r.req_id, _TokenBuffer()).sync(r.token_ids)
            drafts[r.req_id] = lookup(tokens, self.prompt_lookup_min, self.prompt_lookup_max,
                                      min(self.num_speculative_tokens, r.max_drafts))
        return drafts

    def finish(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)

    def close(self) -> None:
        self._buffers.clear()


def lookup(tokens: np.ndarray, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The drafts for one sequence (see the module docstring); [] when no suffix of min_n..max_n
    tokens occurs earlier. One vectorised pass: the windows that end with the last token are the
    candidates, and each is extended backwards while it still matches the suffix, so the cost is
    one comparison over the sequence plus max_n small steps over the candidates."""
    length = len(tokens)
    max_n = min(max_n, length - 1)  # an earlier occurrence needs at least one token before the suffix
    if max_n < min_n or max_drafts < 1:
        return []
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])  # candidate windows end at ends[i]
    if len(ends) == 0:
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # how many suffix tokens each candidate matches
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, max_n):
        starts = ends - m
        alive &= (starts >= 0) & (tokens[np.maximum(starts, 0)] == tokens[length - 1 - m])
        if not alive.any():
            break
        matched += alive
    if matched.max() < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == matched.max())[-1]])  # the longest n, its most recent occurrence
    drafts = tokens[end + 1:end + 1 + max_drafts].tolist()
    # A continuation that runs into the end of the sequence goes on copying itself: the match
    # says the text repeats with this period (an overlapping copy, as in LZ77), so a loop like
    # "a b a b" still gets max_drafts drafts, not just the tokens left before the end.
    period = length - 1 - end
    while len(drafts) < max_drafts:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class _TokenBuffer:
    """A request's tokens as a growing numpy array. Converting the whole list every step costs
    O(context) in Python objects (about a hundred microseconds for 8k tokens); a request's
    tokens only grow between steps (rejected drafts never enter them), so only the new tail is
    copied. A sequence that does not extend the buffered one (a reused req_id) is rebuilt."""

    def __init__(self) -> None:
        self._array = np.empty(0, dtype=np.int64)
        self._length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = self._length
        if len(token_ids) < n or (n and token_ids[n - 1] != self._array[n - 1]):
            n = 0  # not an extension of what is buffered: start over
        if len(token_ids) > len(self._array):
            grown = np.empty(max(2 * len(self._array), len(token_ids), 64), dtype=np.int64)
            grown[:n] = self._array[:n]
            self._array = grown
        if len(token_ids) > n:
            self._array[n:len(token_ids)] = token_ids[n:]
        self._length = len(token_ids)
        return self._array[:self._length]
