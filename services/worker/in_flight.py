"""Handlers still running, so a worker that shuts down can wait for them.

gRPC's `server.stop(grace)` returns once every call has ended, but a call cut at the end
of the grace only ends on the wire: its handler thread runs on (it is told through its
context) and may still use the engine and the kvstore connection. Closing those under it
fails the request with a traceback and leaves its lease to expire; waiting here first
lets it end cleanly (its lease released, its KV write queued or dropped)."""
from __future__ import annotations

import threading


class InFlight:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    def __enter__(self) -> InFlight:
        with self._cond:
            self._count += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    @property
    def count(self) -> int:
        return self._count

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no handler runs (True) or `timeout_s` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._count, timeout_s)
