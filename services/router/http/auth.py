"""The API key check, when one is configured (without one the middleware is not installed).

Every path needs `Authorization: Bearer <key>` except GET /health and /metrics: probes
and Prometheus scrape without credentials, as they do every other pdserve service.
"""
from __future__ import annotations

import hmac

from services.router.http.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyGuard:
    """Pure ASGI (not BaseHTTPMiddleware, which would stand between a stream and the
    client's disconnect)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        problem = self._problem(dict(scope["headers"]).get(b"authorization"))
        if problem is None:
            await self.app(scope, receive, send)
            return
        error = ApiError(401, problem, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _problem(self, header: bytes | None) -> str | None:
        if not header:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            return "invalid API key"
        return None
