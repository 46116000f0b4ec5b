"""The metrics both worker kinds export."""
from __future__ import annotations

from engine.stats import EngineStats
from services.common.metrics import Metrics


class WorkerMetrics:
    """`role` is "prefill" or "decode"; the names are the same for both."""

    def __init__(self, role: str):
        self.role = role
        m = self.metrics = Metrics()
        self.ttft = m.histogram("worker_ttft_seconds", "Time to first token inside the worker")
        self.itl = m.histogram("worker_itl_seconds", "Inter-token latency inside the worker")
        self.e2e = m.histogram("worker_e2e_seconds", "Request time inside the worker")
        self.queue = m.histogram("worker_queue_seconds", "Arrival until first scheduled")
        self.kv_transfer = m.histogram("kv_transfer_seconds", "KV transfer with the kvstore", ("direction",))
        self.prompt_tokens = m.counter("prefill_tokens_total", "Prompt tokens computed or imported")
        self.generated_tokens = m.counter("decode_tokens_total", "Tokens generated")
        self.requests = m.counter("worker_requests_total", "Requests by outcome", ("outcome",))
        self.running = m.gauge("requests_running", "Requests in the running batch")
        self.waiting = m.gauge("requests_waiting", "Requests waiting for admission")
        self.blocks_used = m.gauge("kv_blocks_used", "KV cache blocks in use")
        self.blocks_free = m.gauge("kv_blocks_free", "KV cache blocks free")
        self.prefix_queried = m.gauge("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = m.gauge("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        self.kvstore_imported = m.counter("kvstore_imported_tokens_total", "Prompt tokens imported from the kvstore")
        self.recompute = m.counter("recompute_fallbacks_total", "Blocks the kvstore no longer had, recomputed")
        self.kv_blocks_rejected = m.counter("worker_kv_blocks_rejected_total",
                                            "KV blocks read from the kvstore and refused before use (they and "
                                            "the blocks after them are recomputed), by reason", ("reason",))
        self.kv_write_failures = m.counter("kv_write_failures_total", "Prefills whose KV could not be stored")

    def update(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_free.set(stats.num_free_kv_blocks)
        self.blocks_used.set(stats.num_total_kv_blocks - stats.num_free_kv_blocks)
        self.prefix_queried.set(stats.num_prefix_queried_tokens)
        self.prefix_hits.set(stats.num_prefix_hit_tokens)
