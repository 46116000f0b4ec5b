"""How a request fails, as the client will see it: a gRPC status, a message naming the
cause, and for RESOURCE_EXHAUSTED the retry hint sent as trailing metadata."""
from __future__ import annotations

import grpc

RETRY_AFTER_KEY = "retry-after-ms"


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.retry_after_ms is None else ((RETRY_AFTER_KEY, str(self.retry_after_ms)),)


def retry_after_from(error: grpc.RpcError, default_ms: int) -> int:
    """A worker's own retry hint when it sent one, else the router's default."""
    for key, value in (error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else ():
        if key == RETRY_AFTER_KEY and str(value).isdigit():
            return int(value)
    return default_ms
