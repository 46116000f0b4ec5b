"""Discovery from a file another process rewrites: `pdserve up --autoscale` lists the
workers of each pool in it as they start serving and drops them once they have drained
and exited (a local stand-in for a Service's EndpointSlices).

    {"prefill": ["127.0.0.1:50070", ...], "decode": ["127.0.0.1:50080", ...]}

The writer replaces the file atomically (write a temporary file, rename it), so a read
sees the old list or the new one, never half of one. The registry asks `addresses()` on
every poll; the file is parsed again only when it changed (a rename gives it a new inode,
so two writes within the file system's timestamp granularity are still told apart).
A file that is missing or unreadable keeps the last good answer (logged once per change).
"""
from __future__ import annotations

import json
import logging
import os
import threading

from pdserve.services.router.state.discovery import POOLS, Discovery

logger = logging.getLogger(__name__)


def write_pools(path: str, pools: dict[str, list[str]]) -> None:
    """Replace the file atomically with `pools` (the writer's side)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({pool: list(pools.get(pool, ())) for pool in POOLS}, f)
    os.replace(tmp, path)


def parse_pools(text: str, path: str) -> dict[str, tuple[str, ...]]:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object with 'prefill' and 'decode' lists")
    pools = {}
    for pool in POOLS:
        addresses = data.get(pool, [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
            raise ValueError(f"{path}: '{pool}' must be a list of host:port strings")
        pools[pool] = tuple(addresses)
    return pools


class FileDiscovery(Discovery):
    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None  # (inode, mtime, size) of the file last read
        self._loaded = False
        self._warned = False
        self._pools: dict[str, tuple[str, ...]] = {pool: () for pool in POOLS}

    def start(self, wait_s: float = 0.0) -> bool:
        """The same shape as the Kubernetes discovery's: True once a list was read."""
        self._refresh()
        return self._loaded

    def stop(self) -> None:
        pass

    def addresses(self, pool: str) -> tuple[str, ...]:
        self._refresh()
        with self._lock:
            return self._pools[pool]

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            with open(self.path) as f:
                pools = parse_pools(f.read(), self.path)
        except (OSError, ValueError) as e:
            if not self._warned:  # once per bad spell, not once per poll
                logger.warning("discovery file: %s; keeping the last list", e)
                self._warned = True
            self._stamp = None
            return
        with self._lock:
            self._pools, self._stamp, self._loaded, self._warned = pools, stamp, True, False
        logger.info("discovery file: %s", ", ".join(f"{p} {len(a)}" for p, a in pools.items()))
