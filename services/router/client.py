"""A Python client for the router: stream a generation, or collect it whole."""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from pdserve.engine import SamplingParams
from pdserve.services.common.convert import sampling_to_proto
from pdserve.services.common.grpc_server import channel
from pdserve.services.common.security import ClientSecurity
from pdserve.services.common.tls import ClientTLS
from pdserve.services.pb import common_pb2, router_pb2, router_pb2_grpc


class Generation(NamedTuple):
    """Unpacks as (text, token_ids, finish_reason, usage)."""
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: common_pb2.Usage


class RouterClient:
    def __init__(self, address: str, api_key: str | None = None, tls: ClientTLS | None = None):
        """`api_key`: sent as `authorization: Bearer <key>`; `tls`: the router serves TLS
        (ClientTLS(ca_file=...) for a private CA, ClientTLS() for the system's roots)."""
        self.address = address
        self._channel = channel(address, security=ClientSecurity(api_key, tls))
        self._stub = router_pb2_grpc.RouterStub(self._channel)

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
        return self._stub.Generate(request, timeout=timeout_s)

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
        self._channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
