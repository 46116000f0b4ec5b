"""The metrics both worker kinds export: pdserve's families, and vLLM's beside them
(vllm_metrics.py), fed by the same observations."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.stats import EngineStats
from pdserve.services.common.metrics import Metrics
from pdserve.services.worker.vllm_metrics import VllmMetrics


class WorkerMetrics:
    """`role` is "prefill" or "decode"; the names are the same for both. `model_name`: the
    served name, vLLM's `model_name` label."""

    def __init__(self, role: str, model_name: str = ""):
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
        self.kv_usage = m.gauge("kv_cache_usage_ratio", "KV cache blocks in use / all blocks (0-1)")
        self.preemptions = m.counter("worker_preemptions_total",
                                     "Running requests preempted for KV blocks (recomputed when resumed)")
        self.prefix_queried = m.gauge("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = m.gauge("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        self.host = HostTierMetrics(m)
        self.kvstore_imported = m.counter("kvstore_imported_tokens_total", "Prompt tokens imported from the kvstore")
        self.recompute = m.counter("recompute_fallbacks_total", "Blocks the kvstore no longer had, recomputed")
        self.kv_blocks_rejected = m.counter("worker_kv_blocks_rejected_total",
                                            "KV blocks read from the kvstore and refused before use (they and "
                                            "the blocks after them are recomputed), by reason", ("reason",))
        self.kv_write_failures = m.counter("kv_write_failures_total", "Prefills whose KV could not be stored")
        # a decode worker's finished requests, written for their next turn (finished_kv.py): each
        # full block with KV is written, skipped or failed
        self.finished_kv_written_blocks = m.counter(
            "kv_finished_written_blocks_total",
            "Full blocks of finished requests (prompt + answer) written to the kvstore for the next turn")
        self.finished_kv_written_bytes = m.counter("kv_finished_written_bytes_total",
                                                   "Bytes of the finished requests' blocks written to the kvstore")
        self.finished_kv_skipped_blocks = m.counter(
            "kv_finished_skipped_blocks_total",
            "Full blocks of finished requests not written, by reason: in_store (the kvstore holds them), "
            "queue_full (over --kv-write-finished-max-bytes), evicted (gone from the prefix cache first), "
            "shutdown", ("reason",))
        self.finished_kv_failed_blocks = m.counter(
            "kv_finished_failed_blocks_total",
            "Full blocks of finished requests whose write failed (kvstore full, down or refusing)")
        self.spec = SpecDecodeMetrics(m)
        self.vllm = VllmMetrics(m.registry, model_name)
        self._seen = EngineStats()  # the engine's counts are cumulative: the counters take the increase

    def watch_local_node(self, local_node: Callable[[], object]) -> None:
        """With the Mooncake plane: whether the store node on this host serves the worker's
        transfers now, how often it was found gone, and how many batches moved through it
        (KVStoreClient.local_node; all 0 while there is none)."""
        prefix = self.metrics.prefix
        families = (("worker_mooncake_local_node_up", "Whether KV moves through the Mooncake store node on this "
                     "host (1) or over TCP (0)", GaugeMetricFamily, lambda n: float(n.up)),
                    ("worker_mooncake_local_node_losses", "Times the Mooncake store node on this host was found gone",
                     CounterMetricFamily, lambda n: n.num_gone),
                    ("worker_mooncake_local_transfers", "Puts and gets moved through the Mooncake store node on "
                     "this host", CounterMetricFamily, lambda n: n.num_transfers))

        class LocalNodeCollector:
            def collect(self):
                node = local_node()
                for name, doc, family, value in families:
                    yield family(f"{prefix}_{name}", doc, value=value(node) if node is not None else 0)

        self.metrics.registry.register(LocalNodeCollector())

    def update(self, stats: EngineStats) -> None:
        before, self._seen = self._seen, stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_free.set(stats.num_free_kv_blocks)
        self.blocks_used.set(stats.num_total_kv_blocks - stats.num_free_kv_blocks)
        self.kv_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions - before.num_preemptions)
        self.prefix_queried.set(stats.num_prefix_queried_tokens)
        self.prefix_hits.set(stats.num_prefix_hit_tokens)
        self.host.update(stats, before)
        self.spec.update(stats)
        self.vllm.update(stats, before)

    # ---- one request's observations, into both families ----------------------------
    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        self.vllm.ttft.observe(ttft_s)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.itl.observe(seconds)

    def prompt_computed(self, num_tokens: int) -> None:
        """A prompt this worker prefilled (its cached and imported tokens included)."""
        self.prompt_tokens.inc(num_tokens)
        self.vllm.prompt_tokens.inc(num_tokens)

    def tokens_generated(self, num_tokens: int) -> None:
        self.generated_tokens.inc(num_tokens)
        self.vllm.generation_tokens.inc(num_tokens)

    def request_done(self, e2e_s: float, queue_s: float, finish_reason: str) -> None:
        """A request this worker is done with (`finish_reason` "handoff": it goes on at a
        decode worker, which counts its finish)."""
        self.requests.labels("ok").inc()
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        self.vllm.e2e.observe(e2e_s)
        self.vllm.queue.observe(queue_s)
        self.vllm.finished(finish_reason)

    def request_aborted(self) -> None:
        self.requests.labels("aborted").inc()
        self.vllm.finished("abort")


class HostTierMetrics:
    """The host tier (--kv-offloading-size; engine/core/host_tier.py): prompt tokens looked up
    there (what the device cache missed) and found, since start, as the prefix-cache pair is
    reported; blocks copied each way; its blocks in use and all of them. All zero without one."""

    def __init__(self, m: Metrics):
        self.queried = m.gauge("prefix_cache_host_queried_tokens",
                               "Prompt tokens looked up in the host tier (those the device prefix cache missed)")
        self.hits = m.gauge("prefix_cache_host_hit_tokens", "Prompt tokens found in the host tier")
        self.copied = m.counter("kv_host_copied_blocks_total",
                                "KV blocks copied device -> host (offload) and host -> device (onload)",
                                ("direction",))
        for direction in ("offload", "onload"):  # both series from the start, at 0
            self.copied.labels(direction)
        self.used = m.gauge("kv_host_blocks_used", "Host-tier KV blocks holding a block the device evicted")
        self.capacity = m.gauge("kv_host_blocks_capacity", "Host-tier KV blocks in all (0: no host tier)")

    def update(self, stats: EngineStats, before: EngineStats) -> None:
        host, seen = stats.host, before.host
        self.queried.set(host.num_queried_tokens)
        self.hits.set(host.num_hit_tokens)
        self.copied.labels("offload").inc(host.num_offloaded_blocks - seen.num_offloaded_blocks)
        self.copied.labels("onload").inc(host.num_onloaded_blocks - seen.num_onloaded_blocks)
        self.used.set(host.num_used_blocks)
        self.capacity.set(host.num_total_blocks)


class SpecDecodeMetrics:
    """Speculative decoding (vLLM's spec_decode_* set): draft tokens proposed and scored,
    those accepted, and verifications (one per request per step that had drafts). Over a
    window, the acceptance rate is rate(accepted) / rate(proposed) and the mean accepted
    length rate(accepted) / rate(verifications); the gauges give both since start. All zero
    on a worker that does not speculate (every prefill worker)."""

    def __init__(self, m: Metrics):
        self.proposed = m.counter("worker_spec_proposed_tokens_total", "Draft tokens proposed and verified")
        self.accepted = m.counter("worker_spec_accepted_tokens_total", "Draft tokens accepted by verification")
        self.verifications = m.counter("worker_spec_verifications_total",
                                       "Verifications: one per request per step that had draft tokens")
        self.acceptance_rate = m.gauge("worker_spec_acceptance_rate", "Accepted / proposed draft tokens, since start")
        self.mean_accepted_length = m.gauge("worker_spec_mean_accepted_length",
                                            "Accepted draft tokens per verification, since start")
        self._seen = EngineStats()  # the engine's counts are cumulative: the counters take the increase

    def update(self, stats: EngineStats) -> None:
        before, self._seen = self._seen, stats
        self.proposed.inc(stats.num_spec_proposed_tokens - before.num_spec_proposed_tokens)
        self.accepted.inc(stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens)
        self.verifications.inc(stats.num_spec_verifications - before.num_spec_verifications)
        if stats.num_spec_proposed_tokens:
            self.acceptance_rate.set(stats.num_spec_accepted_tokens / stats.num_spec_proposed_tokens)
        if stats.num_spec_verifications:
            self.mean_accepted_length.set(stats.num_spec_accepted_tokens / stats.num_spec_verifications)
