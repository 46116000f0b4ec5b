"""The router's Prometheus metrics. Latencies are labelled by SLO class and path, so the
HPA can scale the prefill pool on disaggregated TTFT and the decode pool on ITL."""
from __future__ import annotations

from pdserve.services.common.metrics import Metrics
from pdserve.services.router.config import SLOClass
from pdserve.services.router.state.discovery import POOLS
from pdserve.services.router.state.kv_index import KVIndex
from pdserve.services.router.state.workers import WorkerRegistry

STORE_TIER = "store"  # router_kv_index_blocks' tier for the kvstore's blocks
NO_CLASS = "none"  # requests refused before their class was known (no unbounded label values)


class RouterMetrics:
    def __init__(self, slo_classes: dict[str, SLOClass]):
        m = self.metrics = Metrics()
        by = ("slo_class", "path")
        self.ttft = m.histogram("router_ttft_seconds", "Arrival until the first token was sent", by)
        self.itl = m.histogram("router_itl_seconds", "Time between streamed tokens", by)
        self.e2e = m.histogram("router_e2e_seconds", "Arrival until the last message was sent", by)
        self.queue = m.histogram("router_queue_seconds", "Arrival until the first worker call", by)
        self.requests = m.counter("router_requests_total", "Requests by outcome", ("slo_class", "outcome"))
        self.retries = m.counter("router_retries_total", "Worker calls retried on another worker", ("pool",))
        self.paths = m.counter("router_path_decisions_total", "Requests by the path chosen and why (paths.py)",
                               ("path", "reason"))
        self.placements = m.counter("router_placement_total", "Worker choices by pool and why (placement.py)",
                                    ("pool", "reason"))
        self.kv_index_blocks = m.gauge("router_kv_index_blocks",
                                       "Blocks the KV index knows each source to hold, by tier "
                                       "(device or host for a worker, store for the kvstore)", ("source", "tier"))
        self.prefill_fallbacks = m.counter("router_prefill_fallbacks_total",
                                           "Long prompts prefilled by a decode worker: no prefill worker reachable")
        self.migrations = m.counter("router_migrations_total",
                                    "Streams resumed on another decode worker after theirs broke, by why",
                                    ("reason",))
        self.kvstore_up = m.gauge("router_kvstore_up", "Whether the kvstore answers its health checks")
        self.rejections = m.counter("router_admission_rejections_total",
                                    "Requests refused because every worker of a pool was saturated",
                                    ("pool", "slo_class"))
        self.queued = m.gauge("router_queued_requests", "Requests waiting for a worker", ("pool", "slo_class"))
        self.workers_up = m.gauge("router_workers_up", "Workers answering their polls", ("pool",))
        self.workers = m.gauge("router_workers", "Workers known from discovery", ("pool",))
        self.slo_violations = m.counter("router_slo_violations_total", "Tokens later than their class's target",
                                        ("slo_class", "kind"))
        target = m.gauge("router_slo_target_seconds", "Each SLO class's targets", ("slo_class", "kind"))
        for name, slo in slo_classes.items():
            target.labels(name, "ttft").set(slo.ttft_ms / 1000)
            target.labels(name, "itl").set(slo.itl_ms / 1000)
        self._slo = slo_classes

    def observe_ttft(self, slo_class: str, path: str, seconds: float) -> None:
        self.ttft.labels(slo_class, path).observe(seconds)
        if seconds * 1000 > self._slo[slo_class].ttft_ms:
            self.slo_violations.labels(slo_class, "ttft").inc()

    def observe_itl(self, slo_class: str, path: str, seconds: float) -> None:
        self.itl.labels(slo_class, path).observe(seconds)
        if seconds * 1000 > self._slo[slo_class].itl_ms:
            self.slo_violations.labels(slo_class, "itl").inc()

    def update_kv_index(self, index: KVIndex, kvstore_address: str = "") -> None:
        self.kv_index_blocks.clear()  # sources that left drop their series
        for source, by_tier in index.num_blocks_by_tier().items():
            if source == kvstore_address:  # its own tier is the store to the router
                by_tier = {STORE_TIER: sum(by_tier.values())}
            for tier, num_blocks in by_tier.items():
                self.kv_index_blocks.labels(source, tier).set(num_blocks)

    def update_workers(self, registry: WorkerRegistry) -> None:
        for pool in POOLS:
            views = registry.views(pool)
            self.workers.labels(pool).set(len(views))
            self.workers_up.labels(pool).set(sum(v.up for v in views))
        self.kvstore_up.set(registry.kvstore.up)
