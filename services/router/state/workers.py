"""The router's picture of its workers: for each pool, every worker's last reported load,
whether it answered its last poll, and what this router itself has outstanding on it.

The policies see immutable `WorkerView` snapshots (decide/views.py); the registry owns
the mutable records, the channels and the stubs. The router's own in-flight counters matter because a worker's
reported load is up to one poll interval old: a burst of requests between two polls
would otherwise all go to the same "idle" worker.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from grpc_health.v1 import health_pb2_grpc

from pdserve.services.common.grpc_server import channel
from pdserve.services.common.security import ClientSecurity
from pdserve.services.pb import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from pdserve.services.router.decide.views import DECODE, POOLS, PREFILL, QueuedPrefill, WorkerView
from pdserve.services.router.state.discovery import Discovery

_STUBS = {PREFILL: prefill_pb2_grpc.PrefillWorkerStub, DECODE: decode_pb2_grpc.DecodeWorkerStub}
# A worker that restarts should be seen again within a poll or two, not after gRPC's
# default reconnect backoff (up to two minutes).
_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                      ("grpc.max_reconnect_backoff_ms", 1000)]


_LOAD_FIELDS = tuple(f.name for f in common_pb2.WorkerLoad.DESCRIPTOR.fields)


def view_from_load(address: str, load: common_pb2.WorkerLoad, up: bool = True) -> WorkerView:
    fields = {name: getattr(load, name) for name in _LOAD_FIELDS}
    fields["queued_prefill"] = tuple(QueuedPrefill(q.priority, q.min_rank_tokens, q.max_rank_tokens, q.num_requests,
                                                   q.num_tokens) for q in load.queued_prefill)
    return WorkerView(address, up, **fields)


class _Worker:
    def __init__(self, pool: str, address: str, security: ClientSecurity):
        self.channel = channel(address, _RECONNECT_OPTIONS, security)
        self.stub = _STUBS[pool](self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.view = WorkerView(address)
        # dropped by discovery (a terminating pod, a scaled-down worker) with requests still
        # open on it: no new work, kept until they end, so its streams finish rather than break
        self.leaving = False
        # the last poll had an answer, SERVING or not (a draining worker answers NOT_SERVING
        # yet finishes its streams; one that does not answer has them migrate, on_lost)
        self.answering = True


class WorkerRegistry:
    def __init__(self, discovery: Discovery, on_change: Callable[[str], None] = lambda pool: None,
                 security: ClientSecurity = ClientSecurity(), kvstore_address: str = ""):
        """`on_change(pool)` runs (outside the registry's lock) when a pool may have gained
        capacity: a poll's answer or a released request. Never on `reserve`, which runs
        under an admission gate's lock: waking gates from there could deadlock two pools.
        `security`: how the router calls internal ports (its workers', the kvstore's).
        `kvstore_address`: the kvstore whose health is polled with the workers ("": none)."""
        self.security = security
        self._discovery = discovery
        self._on_change = on_change
        self._lock = threading.Lock()
        self._pools: dict[str, dict[str, _Worker]] = {pool: {} for pool in POOLS}
        # callbacks run when a poll finds a worker unreachable (its open decode streams migrate)
        self._lost_watchers: dict[str, dict[int, Callable[[], None]]] = {}
        self._next_watcher = 0
        self.kvstore = KVStoreStatus(kvstore_address, security)
        self.sync()

    def sync(self) -> None:
        """Follow discovery: open channels to new workers, close those of removed ones once
        this router has nothing open on them (until then they only finish what they have)."""
        for pool in POOLS:
            wanted = self._discovery.addresses(pool)
            with self._lock:
                workers = self._pools[pool]
                gone = []
                for address, worker in list(workers.items()):
                    if address in wanted:
                        worker.leaving = False
                    elif worker.view.in_flight and worker.answering:
                        worker.leaving = True
                        worker.view = replace(worker.view, draining=True)
                    else:
                        gone.append(workers.pop(address))
                for address in wanted:
                    if address not in workers:  # (not setdefault: that would open a channel each time)
                        workers[address] = _Worker(pool, address, self.security)
            for worker in gone:
                worker.channel.close()

    def views(self, pool: str) -> list[WorkerView]:
        with self._lock:
            return [self._with_twins(pool, w.view) for w in self._pools[pool].values()]

    def _with_twins(self, pool: str, view: WorkerView) -> WorkerView:
        """A worker of both roles is one engine in two pools: what this router has
        outstanding on it through the other pool (prefills it computes, streams it decodes)
        counts in this pool's view too, until its next report has them."""
        for other, workers in self._pools.items():
            twin = workers.get(view.address) if other != pool else None
            if twin is not None:
                t = twin.view
                view = replace(view, in_flight=view.in_flight + t.in_flight,
                               in_flight_tokens=view.in_flight_tokens + t.in_flight_tokens,
                               unreported_tokens=view.unreported_tokens + t.unreported_tokens)
        return view

    def stub(self, pool: str, address: str):
        with self._lock:
            return self._pools[pool][address].stub

    def stubs(self, pool: str) -> dict[str, tuple[object, health_pb2_grpc.HealthStub]]:
        """Each worker's API stub and health stub, for the poller."""
        with self._lock:
            return {a: (w.stub, w.health) for a, w in self._pools[pool].items()}

    def report(self, pool: str, address: str, load: common_pb2.WorkerLoad | None, serving: bool = True) -> None:
        """A poll's answer; None when the worker did not answer. A worker that answers but
        is not SERVING (draining) takes no new work, yet finishes the streams it has."""
        with self._lock:
            if (worker := self._pools[pool].get(address)) is not None:
                worker.answering = load is not None
        self._update(pool, address, lambda v: replace(view_from_load(address, load, serving), in_flight=v.in_flight,
                                                      in_flight_tokens=v.in_flight_tokens)
                     if load is not None else replace(v, up=False))
        if load is None:
            self._lost(address)

    def on_lost(self, address: str, fn: Callable[[], None]) -> Callable[[], None]:
        """Run fn when a poll finds the worker unreachable (a hung or partitioned worker,
        whose open streams would otherwise wait for ever); returns its unregister."""
        with self._lock:
            key, self._next_watcher = self._next_watcher, self._next_watcher + 1
            self._lost_watchers.setdefault(address, {})[key] = fn

        def unregister() -> None:
            with self._lock:
                watchers = self._lost_watchers.get(address, {})
                watchers.pop(key, None)
                if not watchers:
                    self._lost_watchers.pop(address, None)
        return unregister

    def mark_down(self, pool: str, address: str) -> None:
        """A call failed as if the worker were gone: stop choosing it until it answers a poll,
        in every pool that lists it, not only `pool`, where the call failed (a worker of both
        roles is one process in two pools)."""
        for each in POOLS:
            self._update(each, address, lambda v: replace(v, up=False))

    def reserve(self, pool: str, address: str, tokens: int) -> Callable[[], None]:
        """Count a request as outstanding on the worker; returns its (idempotent) release."""
        self._update(pool, address, _add_in_flight(1, tokens), notify=False)
        once = threading.Lock()

        def release() -> None:
            if once.acquire(blocking=False):  # never released: a second call does nothing
                self._update(pool, address, _add_in_flight(-1, -tokens))
        return release

    def close(self) -> None:
        with self._lock:
            workers = [w for pool in self._pools.values() for w in pool.values()]
            self._pools = {pool: {} for pool in POOLS}
        for worker in workers:
            worker.channel.close()
        self.kvstore.close()

    def _lost(self, address: str) -> None:
        with self._lock:
            watchers = list(self._lost_watchers.pop(address, {}).values())
        for fn in watchers:
            fn()

    def _update(self, pool: str, address: str, change: Callable[[WorkerView], WorkerView],
                notify: bool = True) -> None:
        with self._lock:
            worker = self._pools[pool].get(address)
            if worker is None:  # removed by discovery meanwhile
                return
            worker.view = change(worker.view)
            if worker.leaving:
                worker.view = replace(worker.view, draining=True)
        if notify:
            self._on_change(pool)


class KVStoreStatus:
    """Whether the kvstore answers its health checks, polled with the workers. While it is
    down, prompts skip the prefill pool (their KV could not reach a decode worker: the
    prompt would be prefilled twice) and resumed requests recompute instead of asking it.
    Up until a poll says otherwise; always up when the router knows no kvstore."""

    def __init__(self, address: str, security: ClientSecurity):
        self.address = address
        self._channel = channel(address, _RECONNECT_OPTIONS, security) if address else None
        self.health = health_pb2_grpc.HealthStub(self._channel) if self._channel is not None else None
        self.up = True

    def report(self, up: bool) -> None:
        self.up = up

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


def _add_in_flight(requests: int, tokens: int) -> Callable[[WorkerView], WorkerView]:
    return lambda v: v.reserved(requests, tokens)
