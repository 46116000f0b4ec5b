"""Host buffers for KV bytes, reused once nothing views them any more.

Why: a prompt's KV is tens of MB (47 MB for 1k tokens of SmolLM2 in float32), and glibc
maps an allocation that large afresh each time, so every byte written into it would first
cost a page fault and the kernel zeroing the page: measured here, 22 ms to copy 47 MB into
fresh memory against 2 ms into memory used before, more than the transfer itself (and on a
VM whose freed pages go back to the host, 0.3-0.7 s of a core for 87 MB). Two users: the
TCP client receives answers into them (transports/tcp/client.py), and a CPU worker exports the KV it
puts into them (services/worker/runtime.py).

A buffer is kept after use and handed out again once nothing views it: every view (a
memoryview, a tensor made from it by torch.frombuffer, a numpy view of that tensor) holds
a reference to it, and when its reference count is back to the pool's own nobody can read
or write it any more. At most `max_buffers` are kept (the largest ones); a buffer larger
than asked for serves, viewed to the size asked for.
"""
from __future__ import annotations

import sys
import threading


class ReusedBuffers:
    # sys.getrefcount of a pooled buffer that nothing else holds: the pool's list and the call's argument
    _FREE_REFCOUNT = 2

    def __init__(self, max_buffers: int):
        if max_buffers < 1:
            raise ValueError(f"max_buffers: {max_buffers} must be at least 1")
        self._max_buffers = max_buffers
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []

    def take(self, size: int) -> memoryview:
        """`size` bytes nothing else views (their contents are whatever was there before)."""
        with self._lock:
            for i in range(len(self._buffers)):
                if len(self._buffers[i]) >= size and sys.getrefcount(self._buffers[i]) == self._FREE_REFCOUNT:
                    return memoryview(self._buffers[i])[:size]
            buffer = bytearray(size)
            self._keep(buffer)
            return memoryview(buffer)[:size]

    def _keep(self, buffer: bytearray) -> None:
        """Pools `buffer`, in place of a smaller free one when the pool is full."""
        if len(self._buffers) < self._max_buffers:
            self._buffers.append(buffer)
            return
        free = [i for i in range(len(self._buffers)) if sys.getrefcount(self._buffers[i]) == self._FREE_REFCOUNT]
        if free:
            smallest = min(free, key=lambda i: len(self._buffers[i]))
            if len(self._buffers[smallest]) < len(buffer):
                self._buffers[smallest] = buffer
