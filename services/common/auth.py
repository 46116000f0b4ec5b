"""Bearer tokens on gRPC: the server side checks `authorization: Bearer <token>` metadata,
the client side adds it to every call. One model for every port (docs/security.md):

    router's public ports   the API key        (--api-key / $PDSERVE_API_KEY)
    workers, the kvstore    the internal token (--internal-token-file / $PDSERVE_INTERNAL_TOKEN)

A configured value may list several tokens, comma-separated: a server accepts any of
them, a client sends the first. That is how a token is rotated without downtime (accept
old and new, then send the new, then drop the old).

The standard health service stays open: Kubernetes probes cannot send metadata.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

import grpc

INTERNAL_TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)  # probes: no credentials to send


def parse_tokens(text: str | None, name: str) -> tuple[str, ...]:
    """"a,b" -> ("a", "b"); None or blank -> () (no check). An empty item is an error:
    a stray comma must not make the empty token valid."""
    if text is None or not text.strip():
        return ()
    tokens = tuple(part.strip() for part in text.strip().split(","))
    if any(not t for t in tokens):
        raise ValueError(f"{name}: an empty token in a comma-separated list")
    if any(any(c.isspace() for c in t) for t in tokens):
        raise ValueError(f"{name}: a token must not contain whitespace")
    return tokens


def internal_token(token_file: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The internal token(s) as configured: the file's content, else $PDSERVE_INTERNAL_TOKEN,
    else None (the file wins: a mounted Secret is more deliberate than an inherited variable)."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as e:
            raise ValueError(f"internal_token_file: cannot read {token_file}: {e.strerror}") from None
        if not text:
            raise ValueError(f"internal_token_file: {token_file} is empty")
        return text
    return environ.get(INTERNAL_TOKEN_ENV) or None


def bearer_problem(header: str | bytes | None, tokens: tuple[str, ...], what: str) -> str | None:
    """Why `header` (an Authorization value) is refused, or None when it holds one of `tokens`.
    Every token is compared, in constant time, so the answer's timing says nothing of which."""
    if not header:
        return f"missing {what}: send 'authorization: Bearer <{what.replace(' ', '-')}>'"
    if isinstance(header, str):
        header = header.encode()
    scheme, _, given = header.partition(b" ")
    given = given.strip()
    matches = [hmac.compare_digest(given, t.encode()) for t in tokens]
    if scheme.lower() != b"bearer" or not any(matches):
        return f"invalid {what}"
    return None


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Refuses a call without one of `tokens` with UNAUTHENTICATED, before its handler
    runs and before its request is parsed (the refusing handler has no deserializer)."""

    def __init__(self, tokens: tuple[str, ...], what: str):
        if not tokens:
            raise ValueError("tokens: at least one (without any, install no interceptor)")
        self._tokens, self._what = tokens, what

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        header = next((value for key, value in handler_call_details.invocation_metadata or ()
                       if key == "authorization"), None)
        problem = bearer_problem(header, self._tokens, self._what)
        if problem is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        return None if handler is None else _refusing(handler, problem)


def _refusing(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts."""
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata):
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = metadata


class BearerTokenSender(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        return _CallDetails(details, [*(details.metadata or ()), self._header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)
