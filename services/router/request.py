"""Turning a `GenerateInput` into a `RoutedRequest`: validated, tokenized, classified.

Both fronts build one `GenerateInput` per request, each from its own form (the gRPC
servicer from its GenerateRequest, the HTTP API from its pydantic body), and hand it to
the same `RequestValidator`. Every check names its field (InvalidRequestError.field), the
same names the engine uses, so a bad request fails at the router with the message a worker
would have given, before it costs a worker anything.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine import InvalidRequestError, SamplingParams
from services.common.convert import sampling_to_proto
from services.pb import common_pb2
from services.router.config import SLOClass
from services.router.model_info import ModelInfo

_INT32_LIMIT = 1 << 31
# the sampling fields the hop to the workers carries as int32 (common.proto)
_INT32_FIELDS = ("max_tokens", "top_k", "logprobs")


@dataclass(frozen=True)
class GenerateInput:
    """One request as a front received it, before validation."""
    prompt: str | tuple[int, ...]  # text, or token ids; "" or (): none given
    sampling: SamplingParams       # already checked by the engine's own rules
    req_id: str = ""               # "": the router names the request
    slo_class: str = ""            # "": the router's default class
    model: str = ""                # "": the served model


@dataclass(frozen=True)
class RoutedRequest:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams  # as the workers receive it, built once here
    slo_class: str
    slo: SLOClass
    # chosen by the flow from the pools' state when the request starts (paths.py)
    path: str = ""                 # policy.DIRECT or policy.DISAGGREGATED
    prefill_chunk_tokens: int = 0  # the direct path: chunk cap for the decode worker (0: its own)


class RequestValidator:
    def __init__(self, model: ModelInfo, tokenizer, slo_classes: dict[str, SLOClass], default_slo_class: str):
        self.model = model
        self.tokenizer = tokenizer
        self.slo_classes = slo_classes
        self.default_slo_class = default_slo_class

    def validate(self, inp: GenerateInput) -> RoutedRequest:
        """Raises InvalidRequestError naming the bad field."""
        if inp.model and inp.model not in (self.model.name, self.model.model_id):
            raise InvalidRequestError("model", f"{inp.model!r} is not served here (serving {self.model.name!r})")
        slo_class = inp.slo_class or self.default_slo_class
        if slo_class not in self.slo_classes:
            raise InvalidRequestError("slo_class", f"unknown class {slo_class!r}; known: {sorted(self.slo_classes)}")
        sampling = _to_wire(inp.sampling)
        prompt = self._prompt(inp.prompt)
        return RoutedRequest(inp.req_id or uuid.uuid4().hex, prompt, sampling, slo_class, self.slo_classes[slo_class])

    def _prompt(self, prompt: str | tuple[int, ...]) -> tuple[int, ...]:
        if isinstance(prompt, str):
            token_ids = tuple(self.tokenizer.encode(prompt)) if prompt else ()
        else:
            token_ids = tuple(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty")
        vocab = self.model.vocab_size or _INT32_LIMIT  # unknown: at least what the workers' wire carries
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError("prompt_token_ids", f"every id must be an integer in [0, {vocab})")
        limit = self.model.max_model_len
        if len(token_ids) >= limit:  # as the engine: at least one position must remain to generate
            raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens; the context (max_model_len) is "
                                                f"{limit}, leaving no room to generate")
        return token_ids


def _to_wire(params: SamplingParams) -> common_pb2.SamplingParams:
    """The engine accepts any int, the hop to the workers only int32: refuse what it cannot
    carry here, naming the field (protobuf's own error names none). Only HTTP clients can
    send such values; a gRPC client's own wire is int32 already."""
    values = {name: [getattr(params, name)] for name in _INT32_FIELDS if getattr(params, name) is not None}
    values["stop_token_ids"] = params.stop_token_ids
    for name, field_values in values.items():
        if any(not -_INT32_LIMIT <= v < _INT32_LIMIT for v in field_values):
            raise InvalidRequestError(name, "a value is out of range")
    return sampling_to_proto(params)
