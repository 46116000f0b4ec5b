"""The router's configuration: one frozen dataclass the CLI builds. The settings the
decisions read (RoutingConfig: SLO classes, saturation, paths, placement) are
decide/config.py's, imported here so that callers find every router setting in one module.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.engine.structured.params import DEFAULT_COMPILE_TIMEOUT_S
from pdserve.services.common.defaults import DEFAULT_MODEL, HOST, ROUTER_PORT
from pdserve.services.common.security import API_KEY, ClientSecurity, ServerSecurity
from pdserve.services.router.decide.config import (DEFAULT_SLO_CLASS, PATH_POLICIES, PLACEMENTS, PathConfig,  # noqa: F401
                                                   RoutingConfig, SaturationConfig, SLOClass, default_slo_classes)

# The public gRPC port's message bound, unless --max-request-bytes says otherwise: a larger
# Generate request is refused (RESOURCE_EXHAUSTED) before it is parsed or tokenized.
# Generous, since refusing a legitimate prompt is worse than reading a few MiB: a token id
# is a varint of at most 5 bytes, and a token's text is rarely past 16 UTF-8 bytes.
BYTES_PER_TOKEN = 64
# Generate streams one router may have running on its workers at once, for its server's
# thread count (RouterConfig.server_threads): 64 per worker (max_in_flight_per_worker's
# default) on 64 workers. Threads start on demand: the bound costs nothing idle.
STREAMS_ON_WORKERS = 4096
REQUEST_SLACK_BYTES = 1 << 20  # sampling params, stop strings, ids: everything but the prompt


def max_request_bytes(configured: int | None, max_model_len: int) -> int:
    """The same bound for a gRPC message and an HTTP body (HttpConfig.request_bytes_limit)."""
    return configured if configured is not None else BYTES_PER_TOKEN * max_model_len + REQUEST_SLACK_BYTES


@dataclass(frozen=True)
class RouterConfig(RoutingConfig):
    """The router process: its decisions' settings (RoutingConfig) and its own."""
    model: str = DEFAULT_MODEL
    revision: str | None = None            # of a model named org/name in the Hugging Face cache
    # the names clients use (/v1/models, a request's `model`); empty: `model` and its resolved id
    served_model_names: tuple[str, ...] = ()
    chat_template: str | None = None       # a Jinja file or the template itself; None: the tokenizer's
    prefill_addresses: tuple[str, ...] = ()
    decode_addresses: tuple[str, ...] = ()
    max_model_len: int | None = None  # None: the model's context (config.json / GGUF metadata)
    host: str = HOST
    port: int = ROUTER_PORT
    metrics_port: int | None = None  # None: no /metrics server (the Metrics object still counts)
    poll_timeout_s: float = 1.0
    kv_index_max_blocks: int = 1 << 18     # per source in the router's KV index (bounds its memory)
    max_queued_requests: int = 1024        # admission queue bound, all classes together
    retry_after_ms: int = 500              # the hint sent with RESOURCE_EXHAUSTED
    worker_timeout_s: float | None = None  # per worker call; None: the client's deadline, if any
    # docs/security.md: what the gRPC API asks of clients (the API key, TLS), how the router
    # calls workers and the kvstore (the internal token, TLS), the largest request it reads
    public: ServerSecurity = ServerSecurity(credential=API_KEY)
    internal: ClientSecurity = ClientSecurity()
    max_request_bytes: int | None = None   # None: from max_model_len (max_request_bytes)
    # structured outputs: a spec that takes longer to compile is refused (INVALID_ARGUMENT / 400)
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S

    @property
    def server_threads(self) -> int:
        """The gRPC server's threads (started on demand). Every Generate stream holds one for
        its life, waiting in an admission queue (one per pool) or running on a worker; past
        them, new calls and the health checks (Kubernetes probes, `pdserve up`) would queue
        unseen inside gRPC, and the admission queues, which refuse with a retry hint, would
        never fill. So: both queues full, and STREAMS_ON_WORKERS running."""
        return 2 * self.max_queued_requests + STREAMS_ON_WORKERS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if any(not isinstance(n, str) or not n for n in self.served_model_names):
            raise ValueError(f"served_model_names: each must be a non-empty name, got {self.served_model_names!r}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s: must be > 0, got {self.grammar_compile_timeout_s}")


def load_slo_classes(path: str) -> dict[str, SLOClass]:
    """A JSON object of classes: {"interactive": {"ttft_ms": 500, "itl_ms": 50, "priority": 0}, ...}."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--slo-config: cannot read {path} ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"--slo-config: {path} must hold a non-empty JSON object of classes")
    classes = {}
    for name, spec in raw.items():
        try:
            classes[name] = SLOClass(**spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--slo-config: class {name!r}: {e}") from None
    return classes
