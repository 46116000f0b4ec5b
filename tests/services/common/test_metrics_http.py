"""/metrics keeps the colon of vLLM's names whatever format the scraper negotiates."""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve.services.common.metrics_http import keep_names, serve_metrics

# what Prometheus 2 sends (Debian's 2.42 among them): OpenMetrics first, no escaping scheme
PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.fixture
def url():
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", ("model_name",),
            registry=registry).labels("m").inc(3)
    server = serve_metrics(registry, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    server.server_close()


def _scrape(url: str, accept: str | None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


@pytest.mark.parametrize("accept", [PROMETHEUS_2, "application/openmetrics-text;version=1.0.0;escaping=underscores",
                                    "text/plain;version=0.0.4", None])
def test_the_sample_keeps_vllm_s_name(url, accept):
    content_type, text = _scrape(url, accept)
    assert 'vllm:prompt_tokens_total{model_name="m"} 3.0' in text.splitlines(), text
    assert "vllm_prompt_tokens" not in text
    if accept and accept.startswith("application/openmetrics-text"):
        assert content_type.startswith("application/openmetrics-text") and "escaping=allow-utf-8" in content_type


def test_keep_names_touches_only_openmetrics_choices():
    assert keep_names("application/openmetrics-text; version=1.0.0; escaping=underscores,text/plain;q=0.5") == (
        "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,text/plain;q=0.5")
