"""Keeps the router's KVIndex fed: one thread per source (each worker the registry knows,
and the kvstore) following its KVEvents.Subscribe stream.

    subscribe ─▶ snapshot: index.reset(source) ─▶ batches seq+1, seq+2 ...: index.apply
        │ stream ends, errors, a gap in seq, a new source_id
        └▶ index.drop(source) ─▶ wait (backoff 0.1 s doubling to 2 s) ─▶ subscribe again

While a source is away the index knows nothing of it: requests are placed by load alone
there, never by a stale picture. A source that does not serve KVEvents (an older
worker) answers UNIMPLEMENTED and is retried at the slowest backoff. The subscription asks
for the tiers the index scores (device, host); a source from before tiers sends its blocks
without one, which means device.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import grpc

from pdserve.services.common.grpc_server import channel
from pdserve.services.common.security import ClientSecurity
from pdserve.services.pb import kv_events_pb2, kv_events_pb2_grpc
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.decide.views import POOLS
from pdserve.services.router.state.kv_index import DEVICE, HOST, REMOVED, STORED, BlockNaming, IndexEvent, KVIndex
from pdserve.services.router.state.workers import WorkerRegistry

logger = logging.getLogger(__name__)

_KINDS = {kv_events_pb2.KVEvent.STORED: STORED, kv_events_pb2.KVEvent.REMOVED: REMOVED}
_TIERS = {kv_events_pb2.KVEvent.DEVICE: DEVICE, kv_events_pb2.KVEvent.HOST: HOST}


class _Resubscribe(Exception):
    """The stream skipped a batch or the source restarted: start over from a snapshot."""


class KVSubscription:
    def __init__(self, address: str, index: KVIndex, min_backoff_s: float = 0.1, max_backoff_s: float = 2.0,
                 security: ClientSecurity = ClientSecurity()):
        self.address, self.index, self.security = address, index, security
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{address}", daemon=True)

    def start(self) -> KVSubscription:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = self.min_backoff_s
        while not self._stopped.is_set():
            try:
                if self._follow():
                    delay = self.min_backoff_s  # it worked for a while: come back quickly
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    delay = self.max_backoff_s
                logger.debug("kv events from %s: %s", self.address, e.code())
            except _Resubscribe as e:
                logger.info("kv events from %s: %s; resubscribing", self.address, e)
                delay = self.min_backoff_s
            except Exception:  # a bug must not end the thread: the index just stops knowing
                logger.exception("kv events from %s failed", self.address)
            finally:
                self.index.drop(self.address)
            self._stopped.wait(delay)
            delay = min(delay * 2, self.max_backoff_s)

    def _follow(self) -> bool:
        """Apply the stream until it ends; True when it delivered at least a snapshot."""
        with channel(self.address, security=self.security) as ch:
            call = kv_events_pb2_grpc.KVEventsStub(ch).Subscribe(
                kv_events_pb2.SubscribeKVEventsRequest(tiers=list(_TIERS)))
            with self._lock:
                if self._stopped.is_set():
                    return False
                self._call = call
            source_id, seq = None, 0
            for batch in call:
                if batch.snapshot:
                    naming = BlockNaming(batch.block_size, batch.root_hash) if batch.block_size else None
                    self.index.reset(self.address, naming, index_events(batch))
                elif batch.source_id != source_id or batch.seq != seq + 1:
                    raise _Resubscribe(f"batch {batch.seq} of {batch.source_id} after {seq} of {source_id}")
                else:
                    self.index.apply(self.address, index_events(batch))
                source_id, seq = batch.source_id, batch.seq
            return source_id is not None


def index_events(batch: kv_events_pb2.KVEventBatch) -> list[IndexEvent]:
    """A batch's events as the index takes them; kinds and tiers it does not know are skipped
    (a newer source's: the index only ever misses blocks, never invents them)."""
    return [(_KINDS[e.kind], e.block_hashes, _TIERS[e.tier]) for e in batch.events
            if e.kind in _KINDS and e.tier in _TIERS]


class KVSubscribers:
    """One KVSubscription per wanted source; `sync` follows the registry (each poll round)."""

    def __init__(self, index: KVIndex, security: ClientSecurity = ClientSecurity()):
        self.index, self.security = index, security
        self._lock = threading.Lock()
        self._subs: dict[str, KVSubscription] = {}

    def sync(self, addresses: Iterable[str]) -> None:
        wanted = {a for a in addresses if a}
        with self._lock:
            gone = [self._subs.pop(a) for a in list(self._subs) if a not in wanted]
            for address in wanted - self._subs.keys():
                self._subs[address] = KVSubscription(address, self.index, security=self.security).start()
        for sub in gone:
            sub.stop()

    def close(self) -> None:
        self.sync(())


class KVSources:
    """The sources the KV index follows: every worker the registry knows, and the kvstore;
    none unless placement is "kv" (nothing would read the index)."""

    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, index: KVIndex):
        self.enabled = cfg.placement == "kv"
        self.kvstore_address = cfg.kvstore_address
        self.registry = registry
        self.subscribers = KVSubscribers(index, cfg.internal)

    def sync(self) -> None:
        if self.enabled:
            workers = [v.address for pool in POOLS for v in self.registry.views(pool)]
            self.subscribers.sync([*workers, self.kvstore_address])

    def close(self) -> None:
        self.subscribers.close()
