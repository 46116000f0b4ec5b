"""The kvstore's Prometheus metrics.

Counters count what this process saw (with a shared Redis, Prometheus sums the replicas).
Gauges (bytes, blocks, leases) are read from the store at scrape time, so with a shared
Redis every replica reports the same shared totals. A disk tier's gauges and counters
(kvstore_disk_*) are read from its stats at scrape time too, and only exist with one.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.services.common.metrics import Metrics
from pdserve.services.kvstore.errors import KVStoreError
from pdserve.services.kvstore.stores.base import StoreEvents, StoreStats

logger = logging.getLogger(__name__)


class KVStoreMetrics(StoreEvents):
    def __init__(self, metrics: Metrics | None = None):
        m = self.metrics = metrics or Metrics()
        self.hits_total = m.counter("kvstore_hits", "Blocks found by Get")
        self.misses_total = m.counter("kvstore_misses", "Blocks asked by Get and not found")
        self.evictions_total = m.counter("kvstore_evictions", "Blocks evicted to make room")
        self.puts_rejected_total = m.counter("kvstore_puts_rejected", "Put calls refused", ("reason",))
        self.leases_created_total = m.counter("kvstore_leases_created", "Leases created")
        self.leases_released_total = m.counter("kvstore_leases_released", "Leases released by their holder")
        self.leases_expired_total = m.counter("kvstore_leases_expired", "Leases ended by their TTL")
        self.blocks_lost_total = m.counter("kvstore_blocks_lost",
                                           "Indexed blocks the data plane no longer had, dropped from the index")
        self.put_bytes = m.counter("kvstore_put_bytes", "Block bytes received by Put", ("transport",))
        self.get_bytes = m.counter("kvstore_get_bytes", "Block bytes sent by Get", ("transport",))
        self.put_seconds = m.histogram("kvstore_put_seconds", "Put handling time", ("transport",))
        self.get_seconds = m.histogram("kvstore_get_seconds", "Get handling time", ("transport",))

    def watch(self, stats: Callable[[], StoreStats]) -> None:
        """Report the store's gauges from `stats` at every scrape."""
        self.metrics.registry.register(_StatsCollector(self.metrics.prefix, stats))

    # StoreEvents
    def hits(self, n: int) -> None:
        self.hits_total.inc(n)

    def misses(self, n: int) -> None:
        self.misses_total.inc(n)

    def evictions(self, n: int) -> None:
        self.evictions_total.inc(n)

    def put_rejected(self) -> None:
        self.puts_rejected_total.labels("full").inc()

    def lease_created(self) -> None:
        self.leases_created_total.inc()

    def lease_released(self) -> None:
        self.leases_released_total.inc()

    def leases_expired(self, n: int) -> None:
        self.leases_expired_total.inc(n)

    def blocks_lost(self, n: int) -> None:
        self.blocks_lost_total.inc(n)


_GAUGES = (("kvstore_used_bytes", "Block bytes stored", "used_bytes"),
           ("kvstore_blocks", "Blocks stored", "num_blocks"),
           ("kvstore_capacity_bytes", "Capacity in block bytes", "capacity_bytes"),
           ("kvstore_pinned_blocks", "Blocks pinned by a lease", "num_pinned_blocks"),
           ("kvstore_active_leases", "Leases neither released nor expired", "num_active_leases"))
# the disk tier's (StoreStats.disk): gauges, then counters
_DISK_GAUGES = (("kvstore_disk_used_bytes", "Block bytes in the disk tier's files", "used_bytes"),
                ("kvstore_disk_blocks", "Blocks in the disk tier", "num_blocks"),
                ("kvstore_disk_capacity_bytes", "The disk tier's capacity in block bytes", "capacity_bytes"))
_DISK_COUNTERS = (("kvstore_disk_hits", "Blocks read back from the disk tier on a memory miss", "num_hits"),
                  ("kvstore_disk_writes", "Blocks written to the disk tier", "num_writes"),
                  ("kvstore_disk_writes_skipped", "Blocks not written to disk: its writer's queue was full",
                   "num_skipped_writes"),
                  ("kvstore_disk_write_errors", "Blocks not written to disk: the disk refused", "num_failed_writes"),
                  ("kvstore_disk_corrupt_blocks", "Disk tier files found damaged and deleted", "num_corrupt"))


class _StatsCollector:
    def __init__(self, prefix: str, stats: Callable[[], StoreStats]):
        self._prefix, self._stats = prefix, stats

    def describe(self):
        return []  # unknown until scraped: keeps registration from calling the store

    def collect(self):
        try:
            stats = self._stats()
        except KVStoreError as e:
            # A backend that is down must not fail the scrape: the counters still tell
            # what happened, and the missing gauges show the outage.
            logger.warning("kvstore gauges unavailable: %s", e)
            return
        for name, doc, attr in _GAUGES:
            yield GaugeMetricFamily(f"{self._prefix}_{name}", doc, value=getattr(stats, attr))
        if stats.disk is None:
            return
        for name, doc, attr in _DISK_GAUGES:
            yield GaugeMetricFamily(f"{self._prefix}_{name}", doc, value=getattr(stats.disk, attr))
        for name, doc, attr in _DISK_COUNTERS:  # exposed as NAME_total
            yield CounterMetricFamily(f"{self._prefix}_{name}", doc, value=getattr(stats.disk, attr))
