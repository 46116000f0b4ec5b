"""The kvstore's errors, each carrying the gRPC status it travels as.

They subclass grpc.RpcError and answer `code()` / `details()` like the errors grpc raises,
so a caller handles a failed call the same way whichever transport carried it (workers
catch grpc.RpcError and log `e.code()`).
"""
from __future__ import annotations

import grpc


class KVStoreError(grpc.RpcError):
    """A request the store refused, or a transport failure, with its status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self._code = code
        self._message = message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def __str__(self) -> str:
        return f"{self._code.name}: {self._message}"


class InvalidArgument(KVStoreError):
    """A bad field in a request; the message starts with the field's name."""

    def __init__(self, field: str, detail: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {detail}")
        self.field = field


class LeaseNotFound(KVStoreError):
    """A Put under a lease that was never created, is released, or has expired."""

    def __init__(self, lease_id: str):
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION,
                         f"lease_id: {lease_id!r} is unknown, released or expired")
        self.lease_id = lease_id


class KVStoreFullError(KVStoreError):
    """A Put that does not fit even after evicting every unpinned block; nothing of it was stored."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class BackendUnavailable(KVStoreError):
    """The storage backend (Redis) cannot be reached; the request may be retried."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


def from_status(code: grpc.StatusCode, message: str) -> KVStoreError:
    """The matching error class for a status that came back over a transport."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return KVStoreFullError(message)
    return KVStoreError(code, message)
