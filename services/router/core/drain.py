"""A router that is told to stop (SIGTERM) drains rather than cutting its streams.

    SIGTERM ─▶ drain.start(): new requests refused (gRPC UNAVAILABLE, HTTP 503), health
               NOT_SERVING, so load balancers and clients go elsewhere
           ─▶ wait_idle(drain timeout): the requests in flight finish as usual
           ─▶ cut(): those still running end with a final error that says why (never a
              silent end of stream), then the servers stop

Both fronts (gRPC Router.Generate and the HTTP API) run every request through the one
Front, which runs it inside the drain (`Drain.run`), so they drain the same way and by
the same clock.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TypeVar

import grpc

from pdserve.services.router.core.cancel import Cancellation
from pdserve.services.router.errors import RouterError
from pdserve.services.router.state.readiness import Readiness

T = TypeVar("T")

SHUTTING_DOWN = "the router is shutting down; send the request again (another replica, or this one once restarted)"


class Drain:
    """The requests in flight on this router, and whether it is draining."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._active: dict[int, Cancellation] = {}
        self._cut: set[int] = set()
        self._next_id = 0
        self.draining = False
        self.cut_after_s: float | None = None  # the drain timeout the cut requests were given

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def enter(self, cancel: Cancellation) -> int:
        """Admits a request (its key, for leave/was_cut); refuses it once draining."""
        with self._lock:
            if self.draining:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
            key, self._next_id = self._next_id, self._next_id + 1
            self._active[key] = cancel
            return key

    def leave(self, key: int) -> bool:
        """The request ended; True when the drain cut it (it then ends with an error)."""
        with self._lock:
            self._active.pop(key, None)
            self._lock.notify_all()
            return key in self._cut

    def start(self) -> None:
        with self._lock:
            self.draining = True

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no request is in flight (True) or `timeout_s` passed (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._active, max(0.0, timeout_s))

    def cut(self, after_s: float) -> int:
        """Ends every request still in flight (as its client's cancel would: the workers
        free its blocks); each then fails with an error naming the drain. Returns how many."""
        with self._lock:
            self.cut_after_s = after_s
            self._cut.update(self._active)
            cancels = list(self._active.values())
        for cancel in cancels:
            cancel.cancel()
        return len(cancels)

    def run(self, cancel: Cancellation, messages: Iterator[T]) -> Iterator[T]:
        """`messages`, admitted on the first one asked for (refused once draining); a
        request the drain cut then raises cut_error()."""
        key = self.enter(cancel)
        cut = False
        try:
            yield from messages
        finally:
            cut = self.leave(key)
        if cut:  # the cut looked like a client's cancel to the flow: the client must learn otherwise
            raise self.cut_error()

    def cut_error(self) -> RouterError:
        return RouterError(grpc.StatusCode.UNAVAILABLE,
                           f"the router shut down before this request finished (it was given its drain "
                           f"timeout of {self.cut_after_s:g} s); the answer is incomplete: send it again")


class DrainingReadiness:
    """Readiness as HTTP /health reads it: not ready while draining, whatever the workers."""

    def __init__(self, readiness: Readiness, drain: Drain):
        self._readiness, self._drain = readiness, drain

    def workers_up(self) -> dict[str, int]:
        return self._readiness.workers_up()

    def ready(self, workers_up: dict[str, int] | None = None) -> bool:
        return not self._drain.draining and self._readiness.ready(workers_up)
