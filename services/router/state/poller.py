"""Polls every worker's load and health in the background.

Each round asks all workers at once (GetLoad and the health service, as futures), so one
hung worker costs a round its timeout, not a timeout per worker. A worker is up when both
answer and health says SERVING; a draining worker answers NOT_SERVING and so stops
receiving new work while it finishes what it has. A worker that is merely slow to answer
(a busy CPU, a long step) keeps its last state for a few rounds: only refusals, errors and
repeated time-outs take it out of the pools. A worker that does not answer at all is
"lost": its open decode streams are moved to another worker (WorkerRegistry.on_lost).

The kvstore's health is asked in the same round, under the same rules: while it is down
the router sends no prompt through the prefill pool (decide/paths.py).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from pdserve.services.pb import common_pb2
from pdserve.services.router.state.discovery import POOLS
from pdserve.services.router.state.workers import WorkerRegistry

logger = logging.getLogger(__name__)

MAX_SLOW_ROUNDS = 3  # consecutive poll time-outs before a worker counts as down
_SLOW = object()
_NOT_SERVING = object()
_KVSTORE = "kvstore"  # the kvstore's key among the slow-round counts


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
            kvstore = self._registry.kvstore
            kv_check = (kvstore.health.Check.future(health_pb2.HealthCheckRequest(), timeout=self._timeout_s)
                        if kvstore.health is not None else None)
            for pool, address, load, check in pending:
                # by pool too: a worker of both roles is asked once per pool each round
                answer = self._unless_slow(f"{pool} {address}", _answer(address, load, check))
                if answer is _SLOW:
                    continue  # keep the last report
                if answer is _NOT_SERVING:
                    self._registry.report(pool, address, load.result(), serving=False)
                else:
                    self._registry.report(pool, address, answer)
            if kv_check is not None:
                self._report_kvstore(kvstore, kv_check)
        self._after_round()

    def _unless_slow(self, key: str, answer):
        """A time-out counts as an answer (None: down) only after MAX_SLOW_ROUNDS in a row."""
        if answer is not _SLOW:
            self._slow_rounds.pop(key, None)
            return answer
        self._slow_rounds[key] = self._slow_rounds.get(key, 0) + 1
        return _SLOW if self._slow_rounds[key] < MAX_SLOW_ROUNDS else None

    def _report_kvstore(self, kvstore, check) -> None:
        answer = self._unless_slow(_KVSTORE, _health(kvstore.address, check))
        if answer is not _SLOW:
            if kvstore.up and not answer:
                logger.warning("kvstore %s is down: prompts go to the decode workers directly", kvstore.address)
            kvstore.report(bool(answer))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.poll_once()
            except Exception:  # the poller must outlive any one bad round
                logger.exception("load poll failed")


def _answer(address: str, load_future, check_future):
    """The worker's load; _NOT_SERVING when it answers but is draining; None when it did
    not answer; _SLOW when it timed out."""
    try:
        load = load_future.result()
        serving = check_future.result().status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError as e:
        logger.debug("worker %s did not answer its poll (%s)", address, e.code())
        return _SLOW if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else None
    return load if serving else _NOT_SERVING


def _health(address: str, check_future):
    """True when SERVING; False when it refused or said otherwise; _SLOW when it timed out."""
    try:
        return check_future.result().status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError as e:
        logger.debug("%s did not answer its health check (%s)", address, e.code())
        return _SLOW if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else False
