"""Prometheus metrics: one registry per service instance (several services share a process
in tests), served on its own HTTP port at /metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.services.common.metrics_http import serve_metrics

# Latency buckets from 5 ms to 2 min: CPU runs are slow, GPU runs fast; both must resolve.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Creates metrics in a private registry with a common prefix."""

    def __init__(self, prefix: str = "pdserve"):
        self.registry = CollectorRegistry()
        self.prefix = prefix
        self._http_server = None

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"{self.prefix}_{name}", doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(f"{self.prefix}_{name}", doc, labels, buckets=buckets, registry=self.registry)

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve /metrics over HTTP; returns the bound port."""
        self._http_server = serve_metrics(self.registry, host, port)
        return self._http_server.server_port

    def close(self) -> None:
        """Stop serving /metrics and free the port."""
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (tests and load reports read metrics through this)."""
        found = self.registry.get_sample_value(f"{self.prefix}_{name}", labels or {})
        return 0.0 if found is None else found
