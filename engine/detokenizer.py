"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level BPE: one character may span several
tokens (a partial UTF-8 sequence decodes to U+FFFD) and a token's text can depend on its
neighbours. So each step decodes a small window of recent tokens twice, with and without
the new ones, and emits only the difference once it no longer ends in U+FFFD:

    ids:  [ ...prompt tail... | out0 out1 out2 | new ]
           ^prefix_offset        ^read_offset
    delta = decode(ids[prefix:]) - decode(ids[prefix:read])
"""
from __future__ import annotations

_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool = False, min_tokens: int = 0, skip_special_tokens: bool = True):
        """min_tokens: as vLLM, no stop string ends the output before it has more tokens
        than this (a stop string must end in the text of a later token)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._num_emitted = 0
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.min_tokens = min_tokens
        self._num_output_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_id: int) -> str | None:
        """Add one token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        self._num_output_tokens += 1
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return None  # an incomplete character: wait for the next token
        start = len(self.output_text)
        self.output_text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(start) if self._num_output_tokens > self.min_tokens else None

    def flush(self) -> None:
        """At the end, emit what is still held back (even an incomplete character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text):
            self.output_text += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)

    def _check_stop(self, start: int) -> str | None:
        for s in self.stop:
            idx = self.output_text.find(s, max(0, start - len(s) + 1))
            if idx >= 0:
                self.output_text = self.output_text[:idx + len(s) if self.include_stop else idx]
                return s
        return None

    @property
    def emitted_text(self) -> str:
        return self.output_text[:self._num_emitted]

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted; while running, the last characters that could begin a stop
        string are held back, so a stream never shows a stop string it later removes."""
        end = len(self.output_text) if finished else max(self._num_emitted,
                                                          len(self.output_text) - self._holdback)
        delta = self.output_text[self._num_emitted:end]
        self._num_emitted = end
        return delta
