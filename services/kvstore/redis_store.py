"""The BlockStore kept entirely in Redis (or Valkey): bytes, index, recency, pins, leases
and counters all live there, and every operation is one Lua script (redis_scripts.py).

Why everything and not just the bytes: several kvstore replicas can then serve the same
blocks with the same semantics (a lease created through one replica pins blocks put
through another; one LRU order; one byte count), and a replica that restarts loses
nothing. The cost is that Redis does the eviction scan, once per Put that overflows.

Requirements on the Redis: standalone (not Cluster: the scripts touch keys they compute),
`maxmemory` above capacity_bytes plus overhead with `noeviction`, so Redis never drops a
key behind the store's back; replicas sharing it use the same capacity_bytes.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import redis

from services.kvstore import redis_scripts
from services.kvstore.errors import BackendUnavailable, LeaseNotFound
from services.kvstore.store import NULL_EVENTS, BlockStore, StoredBlock, StoreEvents, StoreStats, last_wins

DEFAULT_PREFIX = "pdserve:kv:"


class RedisBlockStore(BlockStore):
    def __init__(self, url: str, capacity_bytes: int, events: StoreEvents = NULL_EVENTS,
                 clock: Callable[[], float] = time.time, prefix: str = DEFAULT_PREFIX):
        self.capacity_bytes = capacity_bytes
        self._events = events
        self._clock = clock  # wall clock: lease expiry times are compared across replicas
        self._prefix = prefix.encode()
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
        self._scripts = {name: self._redis.register_script(getattr(redis_scripts, name))
                         for name in ("PUT", "GET", "LOOKUP", "CREATE_LEASE", "RELEASE_LEASE", "EXPIRE", "STATS")}
        self._call("EXPIRE")  # fail at start, with the URL in the message, when Redis is not there

    def put(self, blocks: list[StoredBlock], lease_id: str = "") -> int | None:
        args = [self.capacity_bytes, lease_id]
        for block in last_wins(blocks):
            args += [block.key, block.header, block.data]
        reply = self._call("PUT", *args)
        if reply[0] == b"lease":
            raise LeaseNotFound(lease_id)
        if reply[0] == b"full":
            self._events.put_rejected()
            return None
        self._events.evictions(reply[2])
        return reply[1]

    def get(self, keys: list[bytes]) -> list[StoredBlock | None]:
        reply = self._call("GET", *keys)
        found = [StoredBlock(key, reply[3 * i + 1], reply[3 * i + 2]) if reply[3 * i] else None
                 for i, key in enumerate(keys)]
        num_hits = sum(b is not None for b in found)
        self._events.hits(num_hits)
        self._events.misses(len(keys) - num_hits)
        return found

    def lookup(self, keys: list[bytes]) -> int:
        return self._call("LOOKUP", *keys)[0]

    def create_lease(self, ttl_ms: int) -> str:
        lease_id = uuid.uuid4().hex
        self._call("CREATE_LEASE", lease_id, ttl_ms)
        self._events.lease_created()
        return lease_id

    def release_lease(self, lease_id: str, drop_tail: bool) -> bool:
        released = bool(self._call("RELEASE_LEASE", lease_id, int(drop_tail))[0])
        if released:
            self._events.lease_released()
        return released

    def expire_leases(self) -> int:
        return self._script("EXPIRE")[0]

    def stats(self) -> StoreStats:
        used, num_blocks, pinned, num_leases, hits, misses, evictions = self._call("STATS")
        return StoreStats(self.capacity_bytes, used, num_blocks, pinned, num_leases, hits, misses, evictions)

    def close(self) -> None:
        self._redis.close()

    def _call(self, name: str, *args) -> list:
        """Runs a script; returns its reply after the leading expired-lease count."""
        return self._script(name, *args)[1:]

    def _script(self, name: str, *args) -> list:
        try:
            reply = self._scripts[name](args=[self._prefix, int(self._clock() * 1000), *args])
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise BackendUnavailable(f"redis backend unreachable: {e}") from e
        if reply[0]:
            self._events.leases_expired(reply[0])
        return reply
