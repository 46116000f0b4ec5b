"""The API key check, when one is configured (without one the middleware is not installed).

Every path needs `Authorization: Bearer <key>` except GET /health and /metrics: probes
and Prometheus scrape without credentials, as they do every other pdserve service. The
check is the gRPC API's (services/common/auth.py): a comma-separated key lists several,
any of them accepted (rotation, docs/security.md).
"""
from __future__ import annotations

from pdserve.services.common.auth import bearer_problem, parse_tokens
from pdserve.services.common.security import API_KEY
from pdserve.services.router.fronts.http.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyGuard:
    """Pure ASGI (not BaseHTTPMiddleware, which would stand between a stream and the
    client's disconnect)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._keys = parse_tokens(api_key, "api_key")
        if not self._keys:
            raise ValueError("api_key: must not be empty")

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
        return bearer_problem(header, self._keys, API_KEY)
