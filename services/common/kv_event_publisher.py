"""The publishing side of KVEvents.Subscribe (proto/pdserve/v1/kv_events.proto): a source
(a worker's prefix cache, the kvstore) reports which block hashes it gained and lost;
every subscriber (a router) gets a snapshot first, then the changes in order.

    source thread ── publish(changes) ──▶ KVEventPublisher ──▶ subscriber queues
                                           └ `held`: the source's blocks by tier, for snapshots
    RPC thread (one per subscriber) ◀── batches ── its queue (a snapshot instead when it fell behind)

The publisher keeps its own copy of what the source holds, so a snapshot never asks the
source (a worker's engine runs on its own thread and RPC threads must not touch it).

Blocks are held per tier (a worker's DEVICE cache and HOST memory; the kvstore's all in
the default tier, DEVICE: its own). Each subscriber gets only the tiers it asked for, and
DEVICE alone when it named none (a router from before tiers): one batch per change for
every subscriber all the same, some of them empty, so `seq` stays gapless for each.
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Iterator

from pdserve.services.common.grpc_server import ServiceSpec
from pdserve.services.pb import kv_events_pb2, kv_events_pb2_grpc

STORED = kv_events_pb2.KVEvent.STORED
REMOVED = kv_events_pb2.KVEvent.REMOVED
DEVICE = kv_events_pb2.KVEvent.DEVICE
HOST = kv_events_pb2.KVEvent.HOST
SERVICE_NAME = "pdserve.v1.KVEvents"


class _Subscriber:
    def __init__(self, tiers: frozenset[int]):
        self.tiers = tiers  # what it is sent
        self.pending: list[kv_events_pb2.KVEventBatch] = []
        self.resync = True  # the first batch is a snapshot


class KVEventPublisher:
    """Thread-safe. `max_pending` batches may wait per subscriber; past that it gets one
    snapshot instead (a slow router costs itself a resync, never the source memory)."""

    def __init__(self, block_size: int = 0, root_hash: bytes = b"", max_pending: int = 1024):
        self.source_id = uuid.uuid4().hex
        self.block_size, self.root_hash = block_size, root_hash
        self.max_pending = max_pending
        self._held: dict[int, set[bytes]] = {}  # by tier
        self._seq = 0
        self._cond = threading.Condition()
        self._subscribers: list[_Subscriber] = []
        self._closed = False

    @property
    def num_held(self) -> int:
        with self._cond:
            return sum(len(held) for held in self._held.values())

    def num_held_by_tier(self) -> dict[int, int]:
        with self._cond:
            return {tier: len(held) for tier, held in self._held.items() if held}

    def publish(self, changes: Iterable[tuple[int, bytes]], tier: int = DEVICE) -> None:
        """(STORED or REMOVED, block hash) pairs of one tier, in the order they happened."""
        self.publish_tiered((kind, block_hash, tier) for kind, block_hash in changes)

    def publish_tiered(self, changes: Iterable[tuple[int, bytes, int]]) -> None:
        """(STORED or REMOVED, block hash, tier) in the order they happened."""
        events: list[kv_events_pb2.KVEvent] = []
        with self._cond:
            for kind, block_hash, tier in changes:
                held = self._held.setdefault(tier, set())
                (held.add if kind == STORED else held.discard)(block_hash)
                if not events or (events[-1].kind, events[-1].tier) != (kind, tier):
                    events.append(kv_events_pb2.KVEvent(kind=kind, tier=tier))  # runs travel as one event
                events[-1].block_hashes.append(block_hash)
            if events:
                self._seq += 1
                self._send(events)

    def replace(self, blocks: Iterable[tuple[bytes, int]]) -> None:
        """The source lost track of its changes: these (hash, tier) are everything it holds now."""
        held: dict[int, set[bytes]] = {}
        for block_hash, tier in blocks:
            held.setdefault(tier, set()).add(block_hash)
        with self._cond:
            self._held = held
            for sub in self._subscribers:
                sub.pending.clear()
                sub.resync = True
            self._cond.notify_all()

    def close(self) -> None:
        """End every subscription (before the server stops: open streams would hold its grace)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stream(self, is_active: Callable[[], bool], poll_s: float = 1.0,
               tiers: Iterable[int] = ()) -> Iterator[kv_events_pb2.KVEventBatch]:
        """One subscription's batches of `tiers` (none: DEVICE) until the publisher closes or
        `is_active()` turns false."""
        sub = _Subscriber(frozenset(tiers) or frozenset({DEVICE}))
        with self._cond:
            self._subscribers.append(sub)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: sub.pending or sub.resync or self._closed, timeout=poll_s)
                    if self._closed:
                        return
                    if sub.resync:
                        sub.resync, sub.pending = False, []
                        batches = [self._snapshot(sub.tiers)]
                    else:
                        batches, sub.pending = sub.pending, []
                if not is_active():
                    return
                yield from batches
        finally:
            with self._cond:
                self._subscribers.remove(sub)

    # ---- lock held -------------------------------------------------------------------
    def _send(self, events: list[kv_events_pb2.KVEvent]) -> None:
        batches: dict[frozenset[int], kv_events_pb2.KVEventBatch] = {}  # one per set of tiers asked for
        for sub in self._subscribers:
            if sub.resync:
                continue  # its coming snapshot includes this
            if len(sub.pending) >= self.max_pending:
                sub.pending.clear()
                sub.resync = True
                continue
            if sub.tiers not in batches:
                batches[sub.tiers] = self._batch([e for e in events if e.tier in sub.tiers], snapshot=False)
            sub.pending.append(batches[sub.tiers])
        self._cond.notify_all()

    def _snapshot(self, tiers: frozenset[int]) -> kv_events_pb2.KVEventBatch:
        """Everything held in `tiers` as of `seq`, one STORED event per tier: the next change
        batch is seq + 1."""
        events = [kv_events_pb2.KVEvent(kind=STORED, tier=tier, block_hashes=sorted(self._held[tier]))
                  for tier in sorted(tiers) if self._held.get(tier)]
        return self._batch(events, snapshot=True)

    def _batch(self, events, snapshot: bool) -> kv_events_pb2.KVEventBatch:
        return kv_events_pb2.KVEventBatch(source_id=self.source_id, seq=self._seq, snapshot=snapshot,
                                          events=events, block_size=self.block_size, root_hash=self.root_hash)


class KVEventsServicer(kv_events_pb2_grpc.KVEventsServicer):
    def __init__(self, publisher: KVEventPublisher):
        self.publisher = publisher

    def Subscribe(self, request, context):
        yield from self.publisher.stream(context.is_active, tiers=request.tiers)


def kv_events_service(publisher: KVEventPublisher) -> ServiceSpec:
    """The ServiceSpec a server adds to serve KVEvents from `publisher`."""
    return ServiceSpec(SERVICE_NAME, kv_events_pb2_grpc.add_KVEventsServicer_to_server, KVEventsServicer(publisher))
