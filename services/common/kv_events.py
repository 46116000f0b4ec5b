"""The publishing side of KVEvents.Subscribe (proto/pdserve/v1/kv_events.proto): a source
(a worker's prefix cache, the kvstore) reports which block hashes it gained and lost;
every subscriber (a router) gets a snapshot first, then the changes in order.

    source thread ── publish(changes) ──▶ KVEventPublisher ──▶ subscriber queues
                                           └ `held`: the source's blocks, for snapshots
    RPC thread (one per subscriber) ◀── batches ── its queue (a snapshot instead when it fell behind)

The publisher keeps its own copy of what the source holds, so a snapshot never asks the
source (a worker's engine runs on its own thread and RPC threads must not touch it).
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Iterator

from services.common.grpc_server import ServiceSpec
from services.pb import kv_events_pb2, kv_events_pb2_grpc

STORED = kv_events_pb2.KVEvent.STORED
REMOVED = kv_events_pb2.KVEvent.REMOVED
SERVICE_NAME = "pdserve.v1.KVEvents"


class _Subscriber:
    def __init__(self):
        self.pending: list[kv_events_pb2.KVEventBatch] = []
        self.resync = True  # the first batch is a snapshot


class KVEventPublisher:
    """Thread-safe. `max_pending` batches may wait per subscriber; past that it gets one
    snapshot instead (a slow router costs itself a resync, never the source memory)."""

    def __init__(self, block_size: int = 0, root_hash: bytes = b"", max_pending: int = 1024):
        self.source_id = uuid.uuid4().hex
        self.block_size, self.root_hash = block_size, root_hash
        self.max_pending = max_pending
        self._held: set[bytes] = set()
        self._seq = 0
        self._cond = threading.Condition()
        self._subscribers: list[_Subscriber] = []
        self._closed = False

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._held)

    def publish(self, changes: Iterable[tuple[int, bytes]]) -> None:
        """(STORED or REMOVED, block hash) pairs, in the order they happened."""
        events: list[kv_events_pb2.KVEvent] = []
        with self._cond:
            for kind, block_hash in changes:
                (self._held.add if kind == STORED else self._held.discard)(block_hash)
                if not events or events[-1].kind != kind:  # runs of one kind travel as one event
                    events.append(kv_events_pb2.KVEvent(kind=kind))
                events[-1].block_hashes.append(block_hash)
            if events:
                self._seq += 1
                self._send(self._batch(events, snapshot=False))

    def replace(self, block_hashes: Iterable[bytes]) -> None:
        """The source lost track of its changes: this is everything it holds now."""
        with self._cond:
            self._held = set(block_hashes)
            for sub in self._subscribers:
                sub.pending.clear()
                sub.resync = True
            self._cond.notify_all()

    def close(self) -> None:
        """End every subscription (before the server stops: open streams would hold its grace)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stream(self, is_active: Callable[[], bool], poll_s: float = 1.0) -> Iterator[kv_events_pb2.KVEventBatch]:
        """One subscription's batches until the publisher closes or `is_active()` turns false."""
        sub = _Subscriber()
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
                        batches = [self._snapshot()]
                    else:
                        batches, sub.pending = sub.pending, []
                if not is_active():
                    return
                yield from batches
        finally:
            with self._cond:
                self._subscribers.remove(sub)

    # ---- lock held -------------------------------------------------------------------
    def _send(self, batch: kv_events_pb2.KVEventBatch) -> None:
        for sub in self._subscribers:
            if sub.resync:
                continue  # its coming snapshot includes this
            if len(sub.pending) >= self.max_pending:
                sub.pending.clear()
                sub.resync = True
            else:
                sub.pending.append(batch)
        self._cond.notify_all()

    def _snapshot(self) -> kv_events_pb2.KVEventBatch:
        """Everything held as of `seq`: the next change batch is seq + 1."""
        events = [kv_events_pb2.KVEvent(kind=STORED, block_hashes=sorted(self._held))] if self._held else []
        return self._batch(events, snapshot=True)

    def _batch(self, events, snapshot: bool) -> kv_events_pb2.KVEventBatch:
        return kv_events_pb2.KVEventBatch(source_id=self.source_id, seq=self._seq, snapshot=snapshot,
                                          events=events, block_size=self.block_size, root_hash=self.root_hash)


class KVEventsServicer(kv_events_pb2_grpc.KVEventsServicer):
    def __init__(self, publisher: KVEventPublisher):
        self.publisher = publisher

    def Subscribe(self, request, context):
        yield from self.publisher.stream(context.is_active)


def kv_events_service(publisher: KVEventPublisher) -> ServiceSpec:
    """The ServiceSpec a server adds to serve KVEvents from `publisher`."""
    return ServiceSpec(SERVICE_NAME, kv_events_pb2_grpc.add_KVEventsServicer_to_server, KVEventsServicer(publisher))
