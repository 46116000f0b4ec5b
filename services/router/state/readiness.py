"""When the router is ready, by one rule everywhere: at least one decode worker is
reachable, as the load poller last saw. A decode worker alone serves every request (with
no prefill worker up it prefills the prompt itself, see core/flow.py), so prefill workers add
speed, not readiness. HTTP /health, the router's gRPC health service and `pdserve up` all
read it from here."""
from __future__ import annotations

import threading

from pdserve.services.common.grpc_server import RunningServer
from pdserve.services.router.state.discovery import DECODE, POOLS
from pdserve.services.router.state.workers import WorkerRegistry


class Readiness:
    def __init__(self, registry: WorkerRegistry):
        self._registry = registry
        self._lock = threading.Lock()  # the poller's thread and serve() both publish
        self._server: RunningServer | None = None

    def workers_up(self) -> dict[str, int]:
        """Reachable workers per pool, as the load poller last saw them."""
        return {pool: sum(v.up for v in self._registry.views(pool)) for pool in POOLS}

    def ready(self, workers_up: dict[str, int] | None = None) -> bool:
        """`workers_up`: judge a count already taken (a reply that shows both must agree)."""
        return (workers_up or self.workers_up())[DECODE] > 0

    def publish_to(self, server: RunningServer) -> None:
        """From now on `server`'s health service says SERVING exactly when the router is ready."""
        with self._lock:
            self._server = server
        self.update()

    def update(self) -> None:
        """Called after every poll round: the health service follows what the round saw."""
        with self._lock:
            if self._server is not None:
                self._server.set_serving(self.ready())
