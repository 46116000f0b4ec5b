"""The per-pod metric each HPA scales on, read straight from the workers' /metrics.

In a cluster prometheus-adapter serves it (deploy/helm/pdserve/templates/adapter-rules.yaml):

    histogram_quantile(q, sum(rate(<histogram>_bucket[window])) by (le, pod)) >= 0
      or sum(rate(<histogram>_count[window])) by (pod) * 0

Locally there is no Prometheus: `PodMetricSource` scrapes each worker itself, keeps the
scrapes of the last window, and computes the same number from the increase of every
bucket between the oldest scrape in the window and the newest. (rate() extrapolates each
bucket's increase by one common factor, which a quantile does not see.) A pod that served
nothing in the window gets 0, as the rule's `or` gives it; a pod with fewer than two
scrapes in the window has no value yet, like a series rate() cannot compute.
"""
from __future__ import annotations

import math
import re
import urllib.request
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# The histogram behind each pool's HPA metric (the adapter rule's series).
POOL_HISTOGRAMS = {"prefill": "pdserve_worker_ttft_seconds", "decode": "pdserve_worker_itl_seconds"}
_DURATION = re.compile(r"^([0-9]+)(s|m|h)$")


@dataclass(frozen=True)
class MetricSpec:
    """What one pool's HPA metric is: values.yaml's <pool>.autoscaling.metric."""
    histogram: str
    quantile: float
    window_s: float


@dataclass(frozen=True)
class Scrape:
    time_s: float
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last


def parse_duration(text: str, field: str = "window") -> float:
    """A Prometheus range as the chart's schema allows it ("30s", "2m", "1h") in seconds."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"{field}: expected <number>s|m|h, got {text!r}")
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


def metric_specs(values: dict) -> dict[str, MetricSpec]:
    """Each autoscaled pool's metric, from the chart's values."""
    specs = {}
    for pool, histogram in POOL_HISTOGRAMS.items():
        a = values.get(pool, {}).get("autoscaling", {})
        if not a.get("enabled"):
            continue
        m = a.get("metric") or {}
        q = m.get("quantile")
        if not isinstance(q, (int, float)) or not 0 < q < 1:
            raise ValueError(f"{pool}.autoscaling.metric.quantile: must be in (0, 1), got {q!r}")
        specs[pool] = MetricSpec(histogram, float(q), parse_duration(m.get("window"),
                                                                     f"{pool}.autoscaling.metric.window"))
    return specs


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets, +Inf
    last: linear inside the bucket the rank falls in; NaN when there are no observations."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for i, (bound, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(bound):  # in the +Inf bucket: the highest finite bound
                return buckets[i - 1][0] if i > 0 else math.nan
            if i == 0 and bound <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return buckets[-2][0] if len(buckets) > 1 else math.nan


def window_quantile(q: float, oldest: Scrape, newest: Scrape) -> float:
    """The quantile of what was observed between two scrapes; 0 when nothing was."""
    before = dict(oldest.buckets)
    if any(count < before.get(bound, 0.0) for bound, count in newest.buckets):
        before = {}  # the worker restarted: its counters started again from 0
    increase = [(bound, count - before.get(bound, 0.0)) for bound, count in newest.buckets]
    value = histogram_quantile(q, increase)
    return 0.0 if math.isnan(value) else value


def parse_histogram(text: str, name: str) -> tuple[tuple[float, float], ...]:
    """The cumulative buckets of histogram `name` in a /metrics page, summed over labels."""
    sums: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_bucket":
                bound = float(sample.labels["le"])
                sums[bound] = sums.get(bound, 0.0) + sample.value
    return tuple(sorted(sums.items()))


def fetch(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


class PodMetricSource:
    """One pool's pods' metric: `observe()` each sync with the pods' /metrics URLs."""

    def __init__(self, spec: MetricSpec, fetch_text=fetch):
        self.spec = spec
        self._fetch = fetch_text
        self._scrapes: dict[str, deque[Scrape]] = {}

    def observe(self, now_s: float, urls: list[str]) -> dict[str, float]:
        """Scrape every URL; returns url -> its metric (pods without a value left out)."""
        self._scrapes = {u: s for u, s in self._scrapes.items() if u in urls}  # pods gone
        values = {}
        for url in urls:
            try:
                buckets = parse_histogram(self._fetch(url), self.spec.histogram)
            except OSError:  # not serving yet, or just gone: no value, as with a failed scrape
                continue
            if not buckets:
                continue
            value = self._add(url, Scrape(now_s, buckets))
            if value is not None:
                values[url] = value
        return values

    def _add(self, url: str, scrape: Scrape) -> float | None:
        history = self._scrapes.setdefault(url, deque())
        history.append(scrape)
        while history and history[0].time_s < scrape.time_s - self.spec.window_s:
            history.popleft()
        if len(history) < 2:
            return None
        return window_quantile(self.spec.quantile, history[0], history[-1])
