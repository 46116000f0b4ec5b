"""What both fronts, gRPC Router.Generate and the HTTP API, do with a request between
parsing it and answering it: validate it, run it through the flow, and count how it ended
(`router_requests_total` by SLO class and outcome), each run inside the drain (drain.py),
which can refuse it and cut it. Each front only turns its own wire form into a
`GenerateInput` and the results into its own replies."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc

from pdserve.services.pb import common_pb2
from pdserve.services.router.core.cancel import Cancellation, Cancelled
from pdserve.services.router.core.drain import Drain
from pdserve.services.router.core.flow import GenerateFlow
from pdserve.services.router.core.request import GenerateInput, RequestValidator, RoutedRequest
from pdserve.services.router.errors import RouterError
from pdserve.services.router.metrics import NO_CLASS, RouterMetrics

# how a request that failed with a RouterError is counted; any other code is an "error"
OUTCOMES = {grpc.StatusCode.RESOURCE_EXHAUSTED: "rejected", grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.INVALID_ARGUMENT: "invalid"}


class Front:
    def __init__(self, validator: RequestValidator, flow: GenerateFlow, metrics: RouterMetrics,
                 drain: Drain | None = None):
        """`drain`: the router's (stop() drains it); by default one of its own that is never started."""
        self.validator, self.flow, self.metrics = validator, flow, metrics
        self.drain = drain if drain is not None else Drain()

    def validate(self, inp: GenerateInput) -> RoutedRequest:
        """Raises InvalidRequestError naming the field; the front refusing it calls count_invalid."""
        return self.validator.validate(inp)

    def count_invalid(self) -> None:
        """A request refused as malformed, before its SLO class was known; the fronts count
        their own parse errors here too (a bad sampling field, an unparsable body)."""
        self.metrics.requests.labels(NO_CLASS, "invalid").inc()

    def run(self, req: RoutedRequest, arrival: float, cancel: Cancellation,
            time_left: Callable[[], float | None]) -> Iterator[common_pb2.GenerateResponse]:
        """The request's messages; raises RouterError. A cancelled run just ends, unless
        the drain cut it (then it raises the drain's error)."""
        return self.drain.run(cancel, self._counted(req, arrival, cancel, time_left))

    def _counted(self, req: RoutedRequest, arrival: float, cancel: Cancellation,
                 time_left: Callable[[], float | None]) -> Iterator[common_pb2.GenerateResponse]:
        outcome = "cancelled"  # unless it ends otherwise: a closed generator means the client left
        messages = self.flow.run(req, arrival, cancel, time_left)
        try:
            for msg in messages:
                if req.client_req_id:  # the workers know it by the router's id; the client by its own
                    msg.req_id = req.client_req_id
                yield msg
            outcome = "ok"
        except Cancelled:
            return
        except RouterError as e:
            outcome = OUTCOMES.get(e.code, "error")
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            messages.close()  # as `yield from` would: the flow's cleanup runs when the client leaves
            self.metrics.requests.labels(req.slo_class, outcome).inc()
