"""The BlockStore kept entirely in Redis (or Valkey): bytes, index, recency, pins, leases
and counters all live there, and every operation is one Lua script (stores/redis_scripts.py).

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

from pdserve.services.kvstore.stores import redis_scripts
from pdserve.services.kvstore.errors import BackendUnavailable, LeaseNotFound
from pdserve.services.kvstore.stores.base import (NO_LEASE, NULL_EVENTS, WRITE_PENDING, BlockStore, StoredBlock, StoreEvents,
                                                  StoreStats, last_wins)

DEFAULT_PREFIX = "pdserve:kv:"
STAGING_TTL_MS = 60_000   # staged bytes of a Put whose script never ran (the replica died)
_WAIT_POLL_S = (0.001, 0.02)  # wait_write polls the lease's state, backing off from the first to the second
_SCRIPTS = ("PUT", "GET", "LOOKUP", "CREATE_LEASE", "END_WRITE", "WRITE_STATE", "RELEASE_LEASE", "EXPIRE", "STATS")


class RedisBlockStore(BlockStore):
    def __init__(self, url: str, capacity_bytes: int, events: StoreEvents = NULL_EVENTS,
                 clock: Callable[[], float] = time.time, prefix: str = DEFAULT_PREFIX):
        self.capacity_bytes = capacity_bytes
        self._events = events
        self._clock = clock  # wall clock: lease expiry times are compared across replicas
        self._prefix = prefix.encode()
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
        self._scripts = {name: self._redis.register_script(getattr(redis_scripts, name)) for name in _SCRIPTS}
        self._call("EXPIRE")  # fail at start, with the URL in the message, when Redis is not there
        for script in self._scripts.values():  # pipelines call them by sha (see _pipelined)
            self._redis.script_load(script.script)

    def put(self, blocks: list[StoredBlock], lease_id: str = "") -> int | None:
        """One round trip: the bytes are SET under staging keys, pipelined with the script
        that moves them into place (stores/redis_scripts.py); redis-py sends a large value from
        its buffer as it is, without joining it into the command."""
        blocks = last_wins(blocks)
        stage = self._prefix + b"s:" + uuid.uuid4().hex.encode() + b":"
        staged = [stage + str(i).encode() for i in range(len(blocks))]
        args = [self.capacity_bytes, lease_id]
        for block, key in zip(blocks, staged):
            args += [block.key, block.header, len(block.data), key]

        def stage_bytes(pipe) -> None:
            for block, key in zip(blocks, staged):
                pipe.set(key, block.data, px=STAGING_TTL_MS)
        reply, _ = self._pipelined(stage_bytes, "PUT", args, transaction=False)
        if reply[0] == b"lease":
            raise LeaseNotFound(lease_id)
        if reply[0] == b"full":
            self._events.put_rejected()
            return None
        self._events.evictions(reply[2])
        return reply[1]

    def get(self, keys: list[bytes]) -> list[StoredBlock | None]:
        """One round trip: the script (recency, counters, headers) and the GETs of the bytes
        in one MULTI, so no eviction falls between them."""
        def get_bytes(pipe) -> None:
            for key in keys:
                pipe.get(self._prefix + b"d:" + key)
        headers, datas = self._pipelined(get_bytes, "GET", keys, transaction=True)
        found = [StoredBlock(key, header, data) if header and data is not None else None
                 for key, header, data in zip(keys, headers, datas, strict=True)]
        num_hits = sum(b is not None for b in found)
        self._events.hits(num_hits)
        self._events.misses(len(keys) - num_hits)
        return found

    def lookup(self, keys: list[bytes], lease_id: str = "") -> int:
        reply = self._call("LOOKUP", lease_id, *keys)
        if reply[0] == b"lease":
            raise LeaseNotFound(lease_id)
        return reply[0]

    def create_lease(self, ttl_ms: int, write_pending: bool = False) -> str:
        lease_id = uuid.uuid4().hex
        self._call("CREATE_LEASE", lease_id, ttl_ms, int(write_pending))
        self._events.lease_created()
        return lease_id

    def end_write(self, lease_id: str, failed: bool) -> bool:
        return bool(self._call("END_WRITE", lease_id, int(failed))[0])

    def wait_write(self, lease_id: str, timeout_s: float) -> str:
        """Polls: replicas share the lease through Redis, and the write may end through any
        of them. The first polls come fast (a write usually ends soon), then back off."""
        deadline, pause = time.monotonic() + timeout_s, _WAIT_POLL_S[0]
        while True:
            state = self._call("WRITE_STATE", lease_id)[0].decode() or NO_LEASE
            remaining = deadline - time.monotonic()
            if state != WRITE_PENDING or remaining <= 0:
                return state
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, _WAIT_POLL_S[1])

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
        return self._expired(reply)

    def _pipelined(self, commands: Callable, name: str, args: list, transaction: bool) -> tuple[list, list]:
        """One round trip: the commands `commands(pipe)` adds, then the script. Returns the
        script's reply (after the expired-lease count) and the commands' replies.

        EVALSHA, not the Script object: in a pipeline, redis-py would first ask SCRIPT
        EXISTS, a second round trip. A Redis that lost its scripts (restarted) answers
        NOSCRIPT: they are loaded again and the round trip made once more.
        """
        script = self._scripts[name]
        for attempt in (0, 1):
            pipe = self._redis.pipeline(transaction=transaction)
            commands(pipe)
            pipe.evalsha(script.sha, 0, self._prefix, int(self._clock() * 1000), *args)
            try:
                replies = pipe.execute()
                return self._expired(replies[-1])[1:], replies[:-1]
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self._redis.script_load(script.script)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                raise BackendUnavailable(f"redis backend unreachable: {e}") from e
            finally:
                pipe.reset()
        raise AssertionError("unreachable")

    def _expired(self, reply: list) -> list:
        if reply[0]:
            self._events.leases_expired(reply[0])
        return reply
