"""The OpenAI-compatible HTTP API's own configuration (the router's gRPC side has RouterConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.services.common.auth import parse_tokens
from pdserve.services.common.defaults import HOST, ROUTER_HTTP_PORT
from pdserve.services.common.tls import ServerTLS
from pdserve.services.router.fronts.http.parsing import REASONING_PARSERS, TOOL_PARSERS
from pdserve.services.router.config import max_request_bytes

API_KEY_ENV = "PDSERVE_API_KEY"


@dataclass(frozen=True)
class HttpConfig:
    host: str = HOST
    port: int = ROUTER_HTTP_PORT  # 0: any free port (tests)
    api_key: str | None = field(default=None, repr=False)  # set: all but /health, /metrics need "Bearer <key>"
    # (comma-separated: any of them; see docs/security.md)
    tls: ServerTLS | None = None  # set: HTTPS only (the router's --tls-cert-file/--tls-key-file)
    max_choices: int = 64         # n × prompts of one request: each choice is a request on the workers
    max_threads: int = 256        # each running choice holds one thread while the routing flow blocks
    grace_s: float = 5.0          # on stop, how long open responses may take to finish
    # the largest body read (413 past it); None: the router's rule from the context length
    max_request_bytes: int | None = None
    max_messages: int = 1024      # of one chat request (each is at least a few tokens of the context)
    # what is read out of chat outputs (output_parsers.py; vLLM's flags of the same names)
    tool_call_parser: str | None = None   # a TOOL_PARSERS name: the model's tool-call format
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses with it (else: 400)
    reasoning_parser: str | None = None   # a REASONING_PARSERS name: <think>...</think>

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"http_port: must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it unset to disable the check)")
        parse_tokens(self.api_key, "api_key")
        if self.max_choices < 1 or self.max_threads < 1 or self.max_messages < 1:
            raise ValueError("max_choices, max_threads and max_messages: must be >= 1")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        _check_parsers(self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)

    def request_bytes_limit(self, max_model_len: int) -> int:
        """The body bound: the same as the router's gRPC port (--max-request-bytes, else
        generous bytes per token of the context plus slack)."""
        return max_request_bytes(self.max_request_bytes, max_model_len)


def _check_parsers(tool_call_parser: str | None, enable_auto_tool_choice: bool, reasoning_parser: str | None) -> None:
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: {tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:  # vLLM refuses it at start too
        raise ValueError("enable_auto_tool_choice: needs a tool_call_parser (--tool-call-parser NAME)")
