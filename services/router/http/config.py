"""The OpenAI-compatible HTTP API's own configuration (the router's gRPC side has RouterConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.defaults import HOST, ROUTER_HTTP_PORT

API_KEY_ENV = "PDSERVE_API_KEY"


@dataclass(frozen=True)
class HttpConfig:
    host: str = HOST
    port: int = ROUTER_HTTP_PORT  # 0: any free port (tests)
    api_key: str | None = field(default=None, repr=False)  # set: all but /health, /metrics need "Bearer <key>"
    max_choices: int = 64         # n × prompts of one request: each choice is a request on the workers
    max_threads: int = 256        # each running choice holds one thread while the routing flow blocks
    grace_s: float = 5.0          # on stop, how long open responses may take to finish

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"http_port: must be in [0, 65535], got {self.port}")
        if self.api_key == "":
            raise ValueError("api_key: must not be empty (leave it unset to disable the check)")
        if self.max_choices < 1 or self.max_threads < 1:
            raise ValueError("max_choices and max_threads: must be >= 1")
