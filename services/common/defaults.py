"""The platform's default ports and model, in one place: every CLI flag, `pdserve up` and the
services' config dataclasses take their defaults from here (the chart sets its own in values.yaml)."""
from __future__ import annotations

from pdserve.engine.config import DEFAULT_MODEL

ROUTER_PORT = 50051         # gRPC Router
ROUTER_HTTP_PORT = 8000     # the OpenAI-compatible API
KVSTORE_PORT = 50060
PREFILL_PORT = 50070        # `pdserve up` numbers its workers from here
DECODE_PORT = 50080
METRICS_BASE_PORT = 9400    # `pdserve up`: the kvstore's /metrics, then one per worker, then the router's
HOST = "127.0.0.1"
# On SIGTERM: how long a router or worker lets its requests in flight finish (each has
# --drain-timeout-s; the chart passes one value per pool and sets the grace period above it)
DRAIN_TIMEOUT_S = 30.0
KVSTORE_ADDRESS = f"{HOST}:{KVSTORE_PORT}"
ROUTER_ADDRESS = f"{HOST}:{ROUTER_PORT}"

__all__ = ["DEFAULT_MODEL", "ROUTER_PORT", "ROUTER_HTTP_PORT", "KVSTORE_PORT", "PREFILL_PORT", "DECODE_PORT",
           "METRICS_BASE_PORT", "HOST", "DRAIN_TIMEOUT_S", "KVSTORE_ADDRESS", "ROUTER_ADDRESS"]
