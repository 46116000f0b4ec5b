"""The request body bound: a body larger than the limit is refused with 413 before any of it
is parsed, so a 50 MB prompt costs the router neither its tokenizing time nor its memory.

    Content-Length over the limit ─▶ 413 at once, nothing read
    otherwise: read the chunks as they arrive, counting ─▶ over the limit: 413, the rest unread
                                                        └▶ complete: the app gets the body as one chunk

Pure ASGI (not BaseHTTPMiddleware, which would stand between a stream and the client's
disconnect): after the body, `receive` is the server's own again, so the app still sees
the disconnect. The app reads every body whole anyway (FastAPI parses JSON), so reading
it here first costs no memory the app would not have spent.
"""
from __future__ import annotations

from pdserve.services.router.fronts.http.errors import ApiError

TOO_LARGE = 413


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope["headers"])
        if declared is not None and declared > self.max_bytes:
            await self._refuse(declared)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(None)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _refuse(self, declared: int | None):
        size = f"{declared} bytes" if declared is not None else "more"
        return ApiError(TOO_LARGE, f"the request body is too large: {size}, at most {self.max_bytes} bytes "
                                   f"are read (the router's --max-request-bytes, by default from the "
                                   f"model's context length)", code="request_too_large").response()


def _content_length(headers) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None  # not a number: the server refuses it
    return None


def _replay(body: bytes, receive):
    """The body as one message, then the server's own `receive` (the disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return replay
