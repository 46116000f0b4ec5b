"""Router.Generate and Router.ListModels over gRPC: the wire form in and out of the Front
(core/front.py), which validates, runs and counts every request as the HTTP API's does."""
from __future__ import annotations

import dataclasses
import time

import grpc

from pdserve.engine import InvalidRequestError
from pdserve.services.common.convert import sampling_from_proto
from pdserve.services.pb import router_pb2, router_pb2_grpc
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.front import Front
from pdserve.services.router.core.model_info import ModelInfo
from pdserve.services.router.core.request import GenerateInput
from pdserve.services.router.errors import RouterError
from pdserve.services.router.metrics import RouterMetrics

_NO_DEADLINE_S = 365 * 24 * 3600.0


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, cfg: RouterConfig, model: ModelInfo, front: Front):
        self.cfg, self.model, self.front = cfg, model, front

    @property
    def metrics(self) -> RouterMetrics:
        return self.front.metrics

    def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(
            id=self.model.served_name, max_model_len=self.model.max_model_len, vocab_size=self.model.vocab_size)])

    def Generate(self, request, context):
        arrival = time.monotonic()
        try:
            req = self.front.validate(_input(request))
        except InvalidRequestError as e:
            self.front.count_invalid()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        cancel = Cancellation()
        # runs when the RPC ends (a no-op on calls already done); False: it has ended already
        if not context.add_callback(cancel.cancel):
            cancel.cancel()
        try:
            yield from self.front.run(req, arrival, cancel, lambda: self._time_left(context))
        except RouterError as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata(e.trailing_metadata())
            context.abort(e.code, e.message)

    def _time_left(self, context) -> float | None:
        """A worker call's timeout: the client's remaining deadline, capped by the config."""
        left = context.time_remaining()
        limit = self.cfg.worker_timeout_s
        if left is None or left > _NO_DEADLINE_S:  # grpc reports "no deadline" as ~292 years
            return limit
        return left if limit is None else min(left, limit)


def _input(msg: router_pb2.GenerateRequest) -> GenerateInput:
    """Raises InvalidRequestError for a bad sampling field (the engine's own checks)."""
    which = msg.WhichOneof("prompt")
    prompt = msg.text if which == "text" else tuple(msg.token_ids.ids) if which == "token_ids" else ()
    sampling = sampling_from_proto(msg.sampling)
    if msg.n > 1:  # the engine's bound on n applies (SamplingParams validates it)
        sampling = dataclasses.replace(sampling, n=msg.n)
    return GenerateInput(prompt, sampling, msg.req_id, msg.slo_class, msg.model, msg.cache_salt,
                         resume_token_ids=tuple(msg.resume_token_ids))
