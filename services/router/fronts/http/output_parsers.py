"""What this server reads out of chat outputs, as configured (vLLM's flags):

    --tool-call-parser NAME     the model's tool-call format (parsing/: hermes, llama3_json, mistral, pythonic)
    --enable-auto-tool-choice   tool_choice "auto" (the default when tools are given) parses
                                the output with it; without, such a request is a 400 naming
                                tool_choice, with vLLM's message
    --reasoning-parser NAME     <think>...</think> to reasoning_content (parsing/reasoning.py)

tool_choice "none" never parses (the tools are still rendered into the prompt, as vLLM
does); "required" and a named function need no parser: a grammar makes the whole output the
call (structured.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.fronts.http.errors import bad_request
from pdserve.services.router.fronts.http.parsing import REASONING_PARSERS, TOOL_PARSERS
from pdserve.services.router.fronts.http.parsing.reasoning import ReasoningParser
from pdserve.services.router.fronts.http.parsing.tool_parser import ToolParser
from pdserve.services.router.fronts.http.schemas import ChatCompletionRequest

logger = logging.getLogger(__name__)
AUTO_NEEDS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class AutoTools:
    """tool_choice "auto": calls to `names` read from the output by `parser`."""
    parser: ToolParser
    names: frozenset[str]
    parallel: bool = True  # parallel_tool_calls false: only the first call is kept


@dataclass(frozen=True)
class OutputParsers:
    tool_parser: ToolParser | None = None
    auto_tool_choice: bool = False
    reasoning: ReasoningParser | None = None

    @classmethod
    def of(cls, cfg: HttpConfig) -> OutputParsers:
        """The configured parsers (HttpConfig checked their names)."""
        return cls(TOOL_PARSERS.get(cfg.tool_call_parser), cfg.enable_auto_tool_choice,
                   REASONING_PARSERS.get(cfg.reasoning_parser))

    def auto_tools(self, body: ChatCompletionRequest) -> AutoTools | None:
        """The request's auto tool choice, None when it has none; raises ApiError (400)."""
        if not body.tools or body.tool_choice not in (None, "auto"):
            return None
        if not self.auto_tool_choice or self.tool_parser is None:
            raise bad_request("tool_choice", f'{AUTO_NEEDS} on this server; set tool_choice to "none", '
                                             f'"required" or {{"type": "function", "function": {{"name": ...}}}}')
        return AutoTools(self.tool_parser, frozenset(t.function.name for t in body.tools),
                         parallel=body.parallel_tool_calls is not False)

    def warn_about(self, tokenizer) -> None:
        """A template that never reads `tools` shows the model no tools: say so at start."""
        template = getattr(tokenizer, "chat_template", None)
        if self.auto_tool_choice and template is not None and "tools" not in str(template):
            logger.warning("--enable-auto-tool-choice: the chat template does not render tools, so the model "
                           "never sees them; pass --chat-template with one that does")
