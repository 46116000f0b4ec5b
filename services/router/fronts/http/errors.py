"""How the HTTP API fails: OpenAI's error JSON, {"error": {"message", "type", "param",
"code"}}, with the status OpenAI client libraries map to their exception classes:

    400 BadRequestError       a bad field; `param` names it
    401 AuthenticationError   missing or wrong API key
    404 NotFoundError         unknown model (or path)
    429 RateLimitError        admission refused; Retry-After (s) and retry-after-ms headers
    503 InternalServerError   no worker of a pool reachable
    500/504                   a worker failed / the worker timeout passed

The router's own errors arrive as RouterError (a gRPC status) or InvalidRequestError (a
field); both are translated here, so HTTP and gRPC clients learn the same reason. No
message names a worker (RouterError scrubs addresses) or quotes an exception's text (a
bug's 500 says only that it happened; the log has the rest).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine import InvalidRequestError
from pdserve.services.router.core.request import shown
from pdserve.services.router.errors import RouterError

INVALID = "invalid_request_error"
_BY_GRPC_CODE = {  # status, type, code
    grpc.StatusCode.INVALID_ARGUMENT: (400, INVALID, None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "no_worker_available"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "worker_timeout"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        # a client's text quoted back may hold a lone surrogate, which no UTF-8 encoder takes
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(404, f"The model {shown(model)} does not exist; this server serves {served!r}",
                    param="model", code="model_not_found")


def from_invalid(e: InvalidRequestError, rename: Mapping[str, str]) -> ApiError:
    """A field the router or engine refused, under the name the client used for it."""
    message = str(e).split(": ", 1)[-1]
    if e.field == "model":
        return ApiError(404, f"model: {message}", param="model", code="model_not_found")
    return bad_request(rename.get(e.field, e.field), message)


def from_router(e: RouterError) -> ApiError:
    status, type_, code = _BY_GRPC_CODE.get(e.code, (500, "server_error", None))
    headers = {}
    if e.retry_after_ms is not None:
        # Retry-After is whole seconds (RFC 9110); OpenAI's clients also read the exact retry-after-ms
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after_ms / 1000))),
                   "retry-after-ms": str(e.retry_after_ms)}
    return ApiError(status, e.message, type_, code=code, headers=headers)


def from_validation(e: RequestValidationError) -> ApiError:
    """pydantic's 422 as OpenAI's 400, naming the first bad field."""
    errors = e.errors()
    # a union's branches each report: a value the field's own check refused says more than
    # "not a string" from a branch the value was never meant for
    first = next((err for err in errors if err.get("type") == "value_error"), errors[0] if errors else {})
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = _param_path(loc) or None
    message = first.get("msg", "invalid request body")
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}")
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


def _param_path(loc: list[str]) -> str:
    # ["messages", "0", "role"] -> "messages[0].role"; union branch tags ("str", "list[int]") dropped
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool"):
            break
        else:
            out += f".{part}" if out else part
    return out


def server_error(e: Exception) -> ApiError:
    """A bug's 500: its text could name anything (a worker, a path), so it stays in the log."""
    return ApiError(500, "internal error; the router's log has the details", "server_error")


def install_handlers(app: FastAPI, on_invalid_body: Callable[[], None]) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        on_invalid_body()
        return from_validation(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code,
                        headers=e.headers).response()

    @app.exception_handler(Exception)  # a bug: still OpenAI's shape (Starlette logs the traceback)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        return server_error(e).response()
