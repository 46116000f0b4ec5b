"""vLLM's metric families (`vllm:*`), beside pdserve's own on a worker's /metrics, so that
dashboards, KEDA triggers and llm-d's endpoint picker written for vLLM read a pdserve
pool unchanged: vLLM's names, types, help, labels and histogram buckets (vLLM's
vllm/v1/metrics/loggers.py, the V1 set).

Labels: `model_name` (the served name: the worker's first --served-model-name, else its
--model) and `engine` ("0": a worker is one engine, whatever its tensor/pipeline ranks).

The observations are pdserve's own (WorkerMetrics feeds both families from one call), so
each pool reports what it sees of a request (docs/serving.md, "Metrics"):

    prefill pool   TTFT, prompt tokens, the first token as its one generation token;
                   a hand-off is not a finish (its decode counts it)
    decode pool    ITL, the tokens it generated; TTFT and prompt tokens only for the
                   prompts it prefilled itself (the direct path)
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.stats import EngineStats

# vLLM's bucket boundaries, in seconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# the finish reasons a pdserve engine has, under vLLM's names (vLLM's "error" and
# "repetition" never happen here); each series exists from the start, at 0
FINISHED_REASONS = ("stop", "length", "abort")
LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"


class VllmMetrics:
    """The families, each bound to this worker's labels. Counters are named without
    `_total` (prometheus_client appends it on the wire: vllm:prompt_tokens_total)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self._registry = registry
        self._values = (model_name, ENGINE_INDEX)
        self.running = self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # vLLM counts a KV connector's hits here (its CPU offloading connector's among them):
        # the host tier's, of the tokens the device prefix cache missed
        self.external_prefix_cache_queries = self._counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.")
        self.external_prefix_cache_hits = self._counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens.")
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=registry)
        self.request_success = {r: success.labels(*self._values, r) for r in FINISHED_REASONS}
        self.ttft = self._histogram("vllm:time_to_first_token_seconds",
                                    "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds",
                                   "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds",
                                   "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = self._histogram("vllm:request_queue_time_seconds",
                                     "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)

    def update(self, stats: EngineStats, before: EngineStats) -> None:
        """After a step: the gauges, and the engine's cumulative counts as increases."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions - before.num_preemptions)
        self.prefix_cache_queries.inc(stats.num_prefix_queried_tokens - before.num_prefix_queried_tokens)
        self.prefix_cache_hits.inc(stats.num_prefix_hit_tokens - before.num_prefix_hit_tokens)
        self.external_prefix_cache_queries.inc(stats.host.num_queried_tokens - before.host.num_queried_tokens)
        self.external_prefix_cache_hits.inc(stats.host.num_hit_tokens - before.host.num_hit_tokens)

    def finished(self, finish_reason: str) -> None:
        """A request that ended on this worker (a hand-off did not: it goes on elsewhere)."""
        if finish_reason in self.request_success:
            self.request_success[finish_reason].inc()

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, LABELS, registry=self._registry).labels(*self._values)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, LABELS, registry=self._registry).labels(*self._values)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(name, doc, LABELS, buckets=buckets, registry=self._registry).labels(*self._values)
