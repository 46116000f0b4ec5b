"""The router's routing core as the HTTP API calls it: the same Front (validator, flow,
outcome counting) as Router.Generate and the same readiness, called in-process rather
than through a gRPC hop to itself."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.services.pb import common_pb2
from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.core.front import Front
from pdserve.services.router.core.model_info import ModelInfo
from pdserve.services.router.core.request import RoutedRequest
from pdserve.services.router.state.readiness import Readiness


@dataclass(frozen=True)
class Backend:
    model: ModelInfo
    tokenizer: object
    front: Front
    readiness: Readiness
    worker_timeout_s: float | None = None  # HTTP clients send no deadline: the config's cap is the limit
    started: float = 0.0                   # wall-clock start (the `created` of /v1/models)

    def run(self, req: RoutedRequest, arrival: float, cancel: Cancellation) -> Iterator[common_pb2.GenerateResponse]:
        """The request's messages, counted by the Front; raises RouterError. A cancelled run just ends."""
        return self.front.run(req, arrival, cancel, lambda: self.worker_timeout_s)
