"""What the server reads out of a chat model's output text: tool calls in the model's own
format (tool_parser.py, one module per format) and its reasoning (reasoning.py). Pure: no
tokenizer, no I/O; the reply (tool_calls.py, choice_text.py) drives them."""
from __future__ import annotations

from pdserve.services.router.fronts.http.parsing.hermes import HermesParser
from pdserve.services.router.fronts.http.parsing.llama3_json import Llama3JsonParser
from pdserve.services.router.fronts.http.parsing.mistral import MistralParser
from pdserve.services.router.fronts.http.parsing.pythonic import PythonicParser
from pdserve.services.router.fronts.http.parsing.reasoning import ReasoningParser
from pdserve.services.router.fronts.http.parsing.tool_parser import ToolParser

TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
}
