"""Turning a GenerateRequest into a `RoutedRequest`: validated, tokenized, classified.

Every check names its field (InvalidRequestError.field), the same names the engine uses,
so a bad request fails at the router with the message a worker would have given, before
it costs a worker anything.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine import InvalidRequestError, SamplingParams
from services.common.convert import sampling_from_proto
from services.pb import common_pb2, router_pb2
from services.router.config import SLOClass
from services.router.model_info import ModelInfo
from services.router.policy import PathPolicy


@dataclass(frozen=True)
class RoutedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams  # forwarded as sent: the workers apply the same defaults
    params: SamplingParams
    slo_class: str
    slo: SLOClass
    path: str  # policy.DIRECT or policy.DISAGGREGATED


class RequestValidator:
    def __init__(self, model: ModelInfo, tokenizer, slo_classes: dict[str, SLOClass], default_slo_class: str,
                 paths: PathPolicy):
        self.model = model
        self.tokenizer = tokenizer
        self.slo_classes = slo_classes
        self.default_slo_class = default_slo_class
        self.paths = paths

    def validate(self, msg: router_pb2.GenerateRequest) -> RoutedRequest:
        """Raises InvalidRequestError naming the bad field."""
        if msg.model and msg.model not in (self.model.name, self.model.model_id):
            raise InvalidRequestError("model", f"{msg.model!r} is not served here (serving {self.model.name!r})")
        slo_class = msg.slo_class or self.default_slo_class
        if slo_class not in self.slo_classes:
            raise InvalidRequestError("slo_class", f"unknown class {slo_class!r}; known: {sorted(self.slo_classes)}")
        params = sampling_from_proto(msg.sampling)
        prompt = self._prompt(msg)
        return RoutedRequest(msg.request_id or uuid.uuid4().hex, prompt, msg.sampling, params, slo_class,
                             self.slo_classes[slo_class], self.paths.choose(len(prompt), slo_class))

    def _prompt(self, msg: router_pb2.GenerateRequest) -> tuple[int, ...]:
        which = msg.WhichOneof("prompt")
        if which == "text":
            token_ids = tuple(self.tokenizer.encode(msg.text)) if msg.text else ()
        else:
            token_ids = tuple(msg.token_ids.ids) if which == "token_ids" else ()
        if not token_ids:
            raise InvalidRequestError("prompt", "is empty")
        vocab = self.model.vocab_size
        if vocab and any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError("prompt_token_ids", f"every id must be an integer in [0, {vocab})")
        limit = self.model.max_model_len
        if len(token_ids) >= limit:  # as the engine: at least one position must remain to generate
            raise InvalidRequestError("prompt", f"has {len(token_ids)} tokens; the context (max_model_len) is "
                                                f"{limit}, leaving no room to generate")
        return token_ids
