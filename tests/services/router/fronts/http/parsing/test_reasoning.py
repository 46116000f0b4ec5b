"""Reasoning parsers: <think>...</think> apart from the answer, whole and streamed."""
from __future__ import annotations

import pytest

from pdserve.services.router.fronts.http.parsing import REASONING_PARSERS
from pdserve.services.router.fronts.http.parsing.reasoning import ReasoningStream

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]


@pytest.mark.parametrize("parser,text,expected", [
    (R1, "<think>Paris is in France.</think>\n\nParis.", ("Paris is in France.", "\n\nParis.")),
    (R1, "Paris is in France.</think>Paris.", ("Paris is in France.", "Paris.")),   # <think> in the prompt
    (R1, "Still thinking about", ("Still thinking about", None)),                  # cut short while thinking
    (R1, "<think></think>Paris.", (None, "Paris.")),
    (R1, "", (None, None)),
    (QWEN3, "<think>\nhmm\n</think>\n\nParis.", ("\nhmm\n", "\n\nParis.")),
    (QWEN3, "\n<think>hmm</think>Paris.", ("hmm", "Paris.")),
    (QWEN3, "Paris.", (None, "Paris.")),                                            # thinking off
    (QWEN3, "Paris.</think> not a tag here", (None, "Paris.</think> not a tag here")),
    (QWEN3, "<think>cut short", ("cut short", None)),
    (QWEN3, "<thin", (None, "<thin")),
])
def test_whole_outputs(parser, text, expected):
    assert parser.split(text) == expected
    for step in (1, 2, 5):
        assert _streamed(parser, text, step) == (expected[0] or "", expected[1] or "")


def test_a_stream_holds_a_tag_still_arriving():
    stream = ReasoningStream(R1)
    assert stream.feed("<thi", final=False) == ("", "")
    assert stream.feed("<think>Hmm</th", final=False) == ("Hmm", "")
    assert stream.feed("<think>Hmm</think>Paris", final=False) == ("", "Paris")
    qwen = ReasoningStream(QWEN3)
    assert qwen.feed("<", final=False) == ("", "")
    assert qwen.feed("<b>", final=False) == ("", "<b>")  # not <think>: content at once


def _streamed(parser, text: str, step: int) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(parser), "", ""
    ends = list(range(step, len(text), step)) + [len(text)]
    for end in ends:
        r, c = stream.feed(text[:end], final=end == len(text))
        reasoning, content = reasoning + r, content + c
    return reasoning, content
