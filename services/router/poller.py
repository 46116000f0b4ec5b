"""Polls every worker's load and health in the background.

Each round asks all workers at once (GetLoad and the health service, as futures), so one
hung worker costs a round its timeout, not a timeout per worker. A worker is up when both
answer and health says SERVING; a draining worker answers NOT_SERVING and so stops
receiving new work while it finishes what it has. A worker that is merely slow to answer
(a busy CPU, a long step) keeps its last state for a few rounds: only refusals, errors and
repeated time-outs take it out of the pools.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from services.pb import common_pb2
from services.router.discovery import POOLS
from services.router.workers import WorkerRegistry

logger = logging.getLogger(__name__)

MAX_SLOW_ROUNDS = 3  # consecutive poll time-outs before a worker counts as down
_SLOW = object()


class LoadPoller:
    def __init__(self, registry: WorkerRegistry, interval_s: float, timeout_s: float,
                 after_round: Callable[[], None] = lambda: None):
        self._registry = registry
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._after_round = after_round
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-load-poller", daemon=True)
        self._round_lock = threading.Lock()
        self._slow_rounds: dict[str, int] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._timeout_s + 5)

    def poll_once(self) -> None:
        """One round over every worker of every pool; returns when all have answered or timed out."""
        with self._round_lock:  # the background thread and a caller (tests, startup) never interleave
            self._registry.sync()
            pending = []
            for pool in POOLS:
                for address, (stub, health) in self._registry.stubs(pool).items():
                    load = stub.GetLoad.future(common_pb2.GetLoadRequest(), timeout=self._timeout_s)
                    check = health.Check.future(health_pb2.HealthCheckRequest(), timeout=self._timeout_s)
                    pending.append((pool, address, load, check))
            for pool, address, load, check in pending:
                answer = _answer(address, load, check)
                if answer is _SLOW:
                    self._slow_rounds[address] = self._slow_rounds.get(address, 0) + 1
                    if self._slow_rounds[address] < MAX_SLOW_ROUNDS:
                        continue  # keep the last report
                    answer = None
                else:
                    self._slow_rounds.pop(address, None)
                self._registry.report(pool, address, answer)
        self._after_round()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll_once()
            except Exception:  # the poller must outlive any one bad round
                logger.exception("load poll failed")


def _answer(address: str, load_future, check_future):
    """The worker's load; None when it is down or draining; _SLOW when it timed out."""
    try:
        load = load_future.result()
        serving = check_future.result().status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError as e:
        logger.debug("worker %s did not answer its poll (%s)", address, e.code())
        return _SLOW if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else None
    return load if serving else None
