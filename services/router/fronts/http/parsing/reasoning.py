"""Reasoning parsers (vLLM's --reasoning-parser): the model's thinking, written between
`<think>` and `</think>`, told apart from its answer. The thinking goes to the message's
`reasoning_content`, the rest is the content (which the tool-call parser then reads).

    deepseek_r1  the output starts inside the thinking (R1's template opens <think> in the
                 prompt; a <think> the model writes itself is dropped) and the thinking runs
                 to </think>; no </think>: all of it is thinking (cut short while thinking)
    qwen3        thinking only when the output opens with <think> (Qwen3 thinks unless
                 enable_thinking is off); then as deepseek_r1; otherwise all content

    "<think>Paris is in France.</think>\\n\\nParis."  ->  reasoning "Paris is in France.", content "\\n\\nParis."

`decided(text, final)` is prefix-stable, like the tool-call parsers' split: while streaming it
holds back what may still be part of a tag ("</thi"), so the reasoning and content streamed
so far are always prefixes of the final ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.router.fronts.http.parsing.tool_parser import held_suffix, skip_space

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the output begins inside the thinking, <think> or not

    def decided(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of `text` so far: all of it when final."""
        lead = skip_space(text)
        if text.startswith(START, lead):
            opened, at = True, lead + len(START)
        elif not final and len(text) - lead < len(START) and START.startswith(text[lead:]):
            return "", ""  # may be the opening tag, still arriving
        else:
            opened, at = False, 0
        if not (opened or self.starts_inside):
            return "", text
        end = text.find(END, at)
        if end >= 0:
            return text[at:end], text[end + len(END):]
        return text[at:len(text) if final else held_suffix(text, END, at)], ""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content), each None when empty."""
        reasoning, content = self.decided(text, final=True)
        return reasoning or None, content or None


class ReasoningStream:
    """A growing output's new reasoning and content, piece by piece."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self._num_reasoning = self._num_content = 0

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """`text`: the whole output so far; returns the reasoning and content not yet returned."""
        reasoning, content = self.parser.decided(text, final)
        new = reasoning[self._num_reasoning:], content[self._num_content:]
        self._num_reasoning, self._num_content = len(reasoning), len(content)
        return new
