"""The router's routing core as the HTTP API calls it: the same validator, GenerateFlow,
pools (admission, SLO classes, retries), cancellation and metrics as Router.Generate,
called in-process rather than through a gRPC hop to itself."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from engine import InvalidRequestError
from services.pb import router_pb2
from services.router.cancel import Cancellation, Cancelled
from services.router.discovery import POOLS
from services.router.errors import RouterError
from services.router.flow import GenerateFlow
from services.router.metrics import NO_CLASS, RouterMetrics
from services.router.model_info import ModelInfo
from services.router.request import RequestValidator, RoutedRequest
from services.router.workers import WorkerRegistry

# as Router.Generate labels its outcomes
_OUTCOMES = {grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected", grpc.StatusCode.UNAVAILABLE: "unavailable",
             grpc.StatusCode.INVALID_ARGUMENT: "invalid"}


@dataclass(frozen=True)
class Backend:
    model: ModelInfo
    tokenizer: object
    validator: RequestValidator
    flow: GenerateFlow
    metrics: RouterMetrics
    registry: WorkerRegistry
    worker_timeout_s: float | None = None  # HTTP clients send no deadline: the config's cap is the limit
    started: float = 0.0                   # wall-clock start (the `created` of /v1/models)

    def validate(self, msg: router_pb2.GenerateRequest) -> RoutedRequest:
        """Raises InvalidRequestError naming the field, counted as an invalid request."""
        try:
            return self.validator.validate(msg)
        except InvalidRequestError:
            self.count_invalid()
            raise

    def count_invalid(self) -> None:
        self.metrics.requests.labels(NO_CLASS, "invalid").inc()

    def run(self, req: RoutedRequest, arrival: float, cancel: Cancellation) -> Iterator[router_pb2.GenerateResponse]:
        """The request's messages; raises RouterError. A cancelled run just ends."""
        outcome = "cancelled"  # unless it ends otherwise: a closed generator means the client left
        try:
            yield from self.flow.run(req, arrival, cancel, lambda: self.worker_timeout_s)
            outcome = "ok"
        except Cancelled:
            return
        except RouterError as e:
            outcome = _OUTCOMES.get(e.code, "error")
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self.metrics.requests.labels(req.slo_class, outcome).inc()

    def workers_up(self) -> dict[str, int]:
        """Reachable workers per pool, as the load poller last saw them."""
        return {pool: sum(v.up for v in self.registry.views(pool)) for pool in POOLS}
