"""A Python client for the router: stream a generation, or collect it whole.

Given several routers (`pdserve up --routers 2`, the chart's router replicas), it uses the
first and moves on to the next when one cannot be reached; a stream cut by a router's
death is resumed there after the tokens already received (GenerateRequest.resume_token_ids),
so the caller sees one stream, token-exact with greedy or seeded sampling:

    router A:  t0 t1 t2 ✗ (killed)
    router B:  Generate(prompt, resume_token_ids=[t0 t1 t2]) ─▶ t3 t4 ... final
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import grpc

from pdserve.engine import SamplingParams
from pdserve.services.common.convert import sampling_to_proto
from pdserve.services.common.grpc_server import channel
from pdserve.services.common.security import ClientSecurity
from pdserve.services.common.tls import ClientTLS
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)


class Generation(NamedTuple):
    """Unpacks as (text, token_ids, finish_reason, usage)."""
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: common_pb2.Usage


class RouterClient:
    def __init__(self, address: str | Sequence[str], api_key: str | None = None, tls: ClientTLS | None = None):
        """`address`: a router's "host:port", or several (a list, or comma-separated): the
        first serves, the next when it cannot be reached (see the module's docstring).
        `api_key`: sent as `authorization: Bearer <key>`; `tls`: the router serves TLS
        (ClientTLS(ca_file=...) for a private CA, ClientTLS() for the system's roots)."""
        self.addresses = [a.strip() for a in (address.split(",") if isinstance(address, str) else address)]
        if not self.addresses or not all(self.addresses):
            raise ValueError(f"address: {address!r} names no router")
        self.address = self.addresses[0]
        self._security = ClientSecurity(api_key, tls)
        self._current = 0
        self._channels: dict[int, grpc.Channel] = {}

    def _stub_of(self, i: int) -> router_pb2_grpc.RouterStub:
        if i not in self._channels:
            self._channels[i] = channel(self.addresses[i], security=self._security)
        return router_pb2_grpc.RouterStub(self._channels[i])

    @property
    def _stub(self) -> router_pb2_grpc.RouterStub:
        return self._stub_of(self._current)

    def _next_router(self, failed: int) -> int:
        """The router after `failed`, which the next calls use too."""
        self._current = (failed + 1) % len(self.addresses)
        return self._current

    def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                 slo_class: str = "interactive", req_id: str = "", model: str = "",
                 timeout_s: float | None = None, cache_salt: str = "") -> Iterator[common_pb2.GenerateResponse]:
        """The router's stream: iterate it for messages; `.cancel()` it to abort the request.
        With sampling.n > 1 the n completions' messages come interleaved, each with its
        `index` (and its own final message). Raises grpc.RpcError (INVALID_ARGUMENT,
        RESOURCE_EXHAUSTED, UNAVAILABLE, ...)."""
        request = router_pb2.GenerateRequest(req_id=req_id, slo_class=slo_class, model=model, cache_salt=cache_salt)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt)))
        if sampling is not None:
            request.sampling.CopyFrom(sampling_to_proto(sampling))
            request.n = sampling.n
        if len(self.addresses) == 1:
            return self._stub.Generate(request, timeout=timeout_s)
        return ResumingStream(self, request, timeout_s)

    def generate_text(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                      slo_class: str = "interactive", req_id: str = "",
                      timeout_s: float | None = None) -> Generation:
        """The whole generation: (text, token_ids, finish_reason, usage); one completion
        (n 1: iterate generate() for n of them)."""
        if sampling is not None and sampling.n != 1:
            raise ValueError(f"generate_text returns one completion, got n {sampling.n}: iterate generate()")
        text, token_ids, final = [], [], common_pb2.GenerateResponse()
        for msg in self.generate(prompt, sampling, slo_class, req_id, timeout_s=timeout_s):
            text.append(msg.text)
            token_ids.extend(msg.token_ids)
            if msg.finish_reason:
                final = msg
        return Generation("".join(text), token_ids, final.finish_reason, final.usage)

    def list_models(self, timeout_s: float | None = 10.0) -> list[router_pb2.ModelInfo]:
        return list(self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout_s).models)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ResumingStream:
    """Router.Generate's stream over several routers: when the one serving it cannot be
    reached (UNAVAILABLE: it died, or was never up), the request goes to the next one,
    after the tokens received so far (n 1; with n > 1 the error is raised). Each router is
    tried at most once per break. Iterate it; `.cancel()` aborts the request."""

    def __init__(self, client: RouterClient, request: router_pb2.GenerateRequest, timeout_s: float | None):
        self._client, self._request = client, request
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._router = client._current
        self._received: list[int] = []
        self._finished = False
        self.num_resumes = 0  # routers moved to after the first
        self._call = self._start()

    def _start(self):
        left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        request = router_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        request.resume_token_ids[:] = self._received
        return self._client._stub_of(self._router).Generate(request, timeout=left)

    def __iter__(self) -> ResumingStream:
        return self

    def __next__(self) -> common_pb2.GenerateResponse:
        tried = 1
        while True:
            try:
                msg = next(self._call)
            except grpc.RpcError as e:
                if (e.code() != grpc.StatusCode.UNAVAILABLE or self._request.n > 1 or self._finished
                        or tried >= len(self._client.addresses)):
                    raise
                failed = self._client.addresses[self._router]
                self._router = self._client._next_router(self._router)
                tried += 1
                self.num_resumes += 1
                logger.warning("router %s: %s; going on at %s after %d tokens", failed, e.details(),
                               self._client.addresses[self._router], len(self._received))
                self._call = self._start()
                continue
            self._received.extend(msg.token_ids)
            self._finished = self._finished or bool(msg.finish_reason)
            return msg

    def cancel(self) -> None:
        self._call.cancel()
