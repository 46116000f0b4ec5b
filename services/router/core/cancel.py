"""One request's cancellation: the client's stream ending fires it once, and everything
the request has in flight (a prefill future, a decode stream, a wait for admission)
registered a callback that stops it."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Cancelled(Exception):
    """The client went away; the request stops without an answer."""


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next_id = 0

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for fn in callbacks:
            _call_quietly(fn)

    def on_cancel(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Run fn when cancelled (at once if already); returns a function that unregisters it."""
        with self._lock:
            if not self._cancelled:
                key = self._next_id
                self._next_id += 1
                self._callbacks[key] = fn
                return lambda: self._unregister(key)
        _call_quietly(fn)
        return lambda: None

    def raise_if_cancelled(self) -> None:
        if self._cancelled:
            raise Cancelled()

    def _unregister(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)


def _call_quietly(fn: Callable[[], None]) -> None:
    # a callback that fails (e.g. cancelling a finished call) must not stop the others
    try:
        fn()
    except Exception:
        logger.exception("cancellation callback failed")
