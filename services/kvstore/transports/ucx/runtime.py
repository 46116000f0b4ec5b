"""The one asyncio loop, on its own thread, that runs every ucxx call of this process.

Why one per process and not one per server or client: ucxx keeps a single process-wide
context and worker, and ties its progress thread to the event loop it first sees; a
second loop would start a second progress thread on the same worker. So the kvstore's
UCX server and every UCX client in a process (a test runs both) share this loop, and
synchronous callers hand it coroutines.
"""
from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine

# ucxx sets UCX_MEMTYPE_CACHE itself, which this UCX version no longer reads: without this,
# every process that touches UCX prints two warnings about it.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx  # noqa: E402  (after the environment it reads at first use)

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The UCX loop, started on first use; it lives as long as the process."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ucx-loop", daemon=True).start()
        return _loop


def run(coro: Coroutine, timeout: float | None = None):
    """Runs `coro` on the UCX loop and waits for its result (from any thread but that one).
    On timeout the coroutine is cancelled, so it does not go on using its endpoint."""
    future = asyncio.run_coroutine_threadsafe(coro, loop())
    try:
        return future.result(timeout)
    except TimeoutError:
        future.cancel()
        raise


def ucx_version() -> str:
    return ".".join(map(str, ucxx.get_ucx_version()))
