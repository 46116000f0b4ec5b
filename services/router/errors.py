"""How a request fails, as the client will see it: a gRPC status, a message naming the
cause, and for RESOURCE_EXHAUSTED the retry hint sent as trailing metadata.

A client never learns where the router's workers are: a message that names an address (a
failed worker, or a worker's own error that quotes its peers) reaches the client with the
address cut out, and the log keeps the whole text (`detail`)."""
from __future__ import annotations

import logging
import re

import grpc

logger = logging.getLogger(__name__)

RETRY_AFTER_KEY = "retry-after-ms"
HIDDEN = "<address hidden>"

# host:port (a name, IPv4 or [IPv6]), with gRPC's optional scheme ("ipv4:", "dns:///"), and
# bare IP addresses. A lookbehind keeps words like "line:12" or "UNKNOWN:" out of it.
_ADDRESS = re.compile(
    r"(?:\b(?:ipv4|ipv6|dns|unix|unix-abstract):(?://[^/\s]*/)?)?"
    r"(?:(?:\[|%5B)[0-9A-Fa-f:.%\w]*?(?:\]|%5D)(?::\d{1,5})?"  # [::1]:50051, %5B::1%5D:50051
    r"|(?<![\w.-])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?"  # 10.0.0.7, 10.0.0.7:50051
    r"|(?<![\w.-])[A-Za-z0-9](?:[\w-]*\.)*[\w-]+:\d{1,5}\b)")  # localhost:50051, decode-0.svc:50051


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code = code
        self.detail = message              # for the log: may name workers
        self.message = scrub(message)      # for the client
        self.retry_after_ms = retry_after_ms
        if self.message != message:
            # built on a worker call's failure path, the one place that knows the address
            logger.warning("%s: %s", code.name, message)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.retry_after_ms is None else ((RETRY_AFTER_KEY, str(self.retry_after_ms)),)


def scrub(message: str) -> str:
    """`message` without the network addresses in it."""
    return _ADDRESS.sub(HIDDEN, message)


def retry_after_from(error: grpc.RpcError, default_ms: int) -> int:
    """A worker's own retry hint when it sent one, else the router's default."""
    for key, value in (error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else ():
        if key == RETRY_AFTER_KEY and str(value).isdigit():
            return int(value)
    return default_ms
