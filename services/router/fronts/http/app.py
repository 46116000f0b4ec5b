"""The FastAPI app: OpenAI's completions, chat completions and models, vLLM's /tokenize,
/detokenize and /version (tokenize.py), plus /health and /metrics. One request's way:

    body (pydantic) ─▶ translate: Job (a GenerateInput per choice) ─▶ validate each,
    by the same Front as Router.Generate ─▶ RunGroup: every choice through the routing flow ─▶
    Reply: one JSON body, or SSE chunks ("data: {json}\\n\\n" ... "data: [DONE]\\n\\n")

A stream's headers wait for every choice's first message, so a refusal (429, 503) is
still the status, not an error inside a 200 stream. A client that disconnects, whether
its response is streaming or not, cancels every choice.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from pdserve.engine import InvalidRequestError
from pdserve.services.common.version import pdserve_version
from pdserve.services.router.errors import RouterError
from pdserve.services.router.fronts.http.auth import ApiKeyGuard
from pdserve.services.router.fronts.http.backend import Backend
from pdserve.services.router.fronts.http.config import HttpConfig
from pdserve.services.router.fronts.http.errors import (ApiError, from_invalid, from_router, install_handlers, model_not_found,
                                                        server_error)
from pdserve.services.router.fronts.http.fields import IgnoredFields
from pdserve.services.router.fronts.http.limits import BodyLimit
from pdserve.services.router.fronts.http.logprobs import TokenText
from pdserve.services.router.fronts.http.output_parsers import OutputParsers
from pdserve.services.router.fronts.http.replies import ChatReply, CompletionReply, Reply
from pdserve.services.router.fronts.http.runs import RunGroup
from pdserve.services.router.fronts.http.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.services.router.fronts.http.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from pdserve.services.router.fronts.http.translate import Job, chat_job, completion_job

logger = logging.getLogger(__name__)

SLO_HEADER = "x-pdserve-slo"
_CLIENT_CLOSED = 499  # nobody reads it: the status logged for a client that went away


def create_app(backend: Backend, cfg: HttpConfig, executor: Executor) -> FastAPI:
    # /openapi.json: the request bodies' schema (clients, and the fuzz tests, generate from it)
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_handlers(app, on_invalid_body=backend.front.count_invalid)
    # added first, so it runs after the key check: a stranger's body is never read
    app.add_middleware(BodyLimit, max_bytes=cfg.request_bytes_limit(backend.model.max_model_len))
    if cfg.api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=cfg.api_key)
    api = _Api(backend, cfg, executor)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"])
    # vLLM's: tokenizing with the served model's tokenizer, and the server's version
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    return app


class _Api:
    def __init__(self, backend: Backend, cfg: HttpConfig, executor: Executor):
        self.backend, self.cfg, self.executor = backend, cfg, executor
        self.text_of = TokenText(backend.tokenizer)
        self.ignored = IgnoredFields()  # each ignored or unknown body field logged once (fields.py)
        self.parsers = OutputParsers.of(cfg)
        self.parsers.warn_about(backend.tokenizer)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._generate(request, CompletionReply, lambda: self.ignored.noted(body, completion_job(
            body, self.backend.model, request.headers.get(SLO_HEADER), self.cfg.max_choices)))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._generate(request, ChatReply, lambda: self.ignored.noted(body, chat_job(
            body, self.backend.model, self.backend.tokenizer, request.headers.get(SLO_HEADER), self.cfg.max_choices,
            self.cfg.max_messages, self.parsers)))

    async def models(self) -> dict:
        """One card per --served-model-name (vLLM's), the first first; without: the model's."""
        m = self.backend.model
        return {"object": "list", "data": [self._card(name) for name in m.served_model_names or (m.name,)]}

    async def model(self, model: str) -> dict:
        if not self.backend.model.serves(model):
            raise model_not_found(model, self.backend.model.served_name)
        return self._card(model if self.backend.model.served_model_names else self.backend.model.name)

    async def tokenize(self, body: TokenizeRequest) -> dict:
        # a chat template and a long prompt are CPU work: off the event loop
        return await run_in_threadpool(tokenize, body, self.backend.model, self.backend.tokenizer,
                                       self.cfg.max_messages)

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        return await run_in_threadpool(detokenize, body, self.backend.model, self.backend.tokenizer)

    async def version(self) -> dict:
        return {"version": pdserve_version()}

    async def health(self) -> JSONResponse:
        """200 when the router is ready (state/readiness.py: a decode worker is reachable), else 503."""
        up = self.backend.readiness.workers_up()
        ready = self.backend.readiness.ready(up)
        return JSONResponse({"status": "ok" if ready else "unavailable", "workers_up": up},
                            status_code=200 if ready else 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.backend.front.metrics.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    def _card(self, name: str) -> dict:
        m = self.backend.model
        return {"id": name, "object": "model", "created": int(self.backend.started), "owned_by": "pdserve",
                "root": m.model_id, "max_model_len": m.max_model_len}

    async def _generate(self, request: Request, reply_type: type[Reply], make_job: Callable[[], Job]) -> Response:
        arrival = time.monotonic()
        # tokenizing (chat template, text prompts) is CPU work: off the event loop
        job, routed = await run_in_threadpool(self._prepare, make_job)
        group = RunGroup(self.backend, routed, arrival, self.executor)
        reply = reply_type(job, self.backend.model.served_name, self.text_of, [r.prompt_token_ids for r in routed])
        try:
            if job.stream:
                first = await _unless_disconnected(request, group.first_messages())
                return EventStream(_events(reply, group, first), on_close=group.cancel)
            await _unless_disconnected(request, _collect(reply, group))
            return JSONResponse(reply.whole())
        except _ClientGone:
            group.cancel()
            return Response(status_code=_CLIENT_CLOSED)
        except RouterError as e:
            group.cancel()
            raise from_router(e) from None
        except BaseException:
            group.cancel()
            raise

    def _prepare(self, make_job: Callable[[], Job]):
        front = self.backend.front
        try:
            job = make_job()
        except ApiError as e:
            if e.status in (400, 404):
                front.count_invalid()
            raise
        try:
            return job, [front.validate(inp) for inp in job.inputs]
        except InvalidRequestError as e:
            front.count_invalid()
            raise from_invalid(e, job.rename) from None


class EventStream(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends: finished,
    failed, cancelled by the server's shutdown, or the client gone."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _events(reply: Reply, group: RunGroup, first: list) -> AsyncIterator[bytes]:
    for chunk in reply.opening():
        yield _sse(chunk)
    for index, msg in first:
        yield _sse(reply.add(index, msg))
    try:
        while (message := await group.next()) is not None:
            yield _sse(reply.add(*message))
        if reply.job.include_usage:
            yield _sse(reply.usage_chunk())
    except RouterError as e:  # the status is sent already: the error goes into the stream
        yield _sse(from_router(e).body())
    except Exception as e:
        logger.exception("stream %s failed", reply.id)
        yield _sse(server_error(e).body())
    yield b"data: [DONE]\n\n"


async def _collect(reply: Reply, group: RunGroup) -> None:
    while (message := await group.next()) is not None:
        reply.add(*message)


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, awaitable):
    """The awaitable's result, or _ClientGone as soon as the client disconnects."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise _ClientGone()


async def _disconnected(request: Request) -> None:
    # the body is read already: the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass
