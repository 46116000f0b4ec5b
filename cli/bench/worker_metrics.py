"""What the workers count about a run, read from their Prometheus /metrics before and after
it: speculative decoding's draft tokens proposed and accepted, and its verifications (the
bench sees only tokens, not how many steps made them). The workers are named by the user
(`--worker-metrics`, the URLs `pdserve up` prints); counters are summed over them, and
the report shows the run's increase."""
from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# services/worker/metrics.py: SpecDecodeMetrics
SPEC_COUNTERS = {"proposed": "pdserve_worker_spec_proposed_tokens_total",
                 "accepted": "pdserve_worker_spec_accepted_tokens_total",
                 "verifications": "pdserve_worker_spec_verifications_total"}


@dataclass(frozen=True)
class SpecCounts:
    proposed: float = 0.0
    accepted: float = 0.0
    verifications: float = 0.0


def metrics_url(text: str) -> str:
    """host:port, http://host:port or a full /metrics URL -> the /metrics URL."""
    url = text if "://" in text else f"http://{text}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def scrape_spec(urls: tuple[str, ...], timeout_s: float = 5.0) -> SpecCounts:
    """The workers' speculation counters, summed; an unreachable worker raises ValueError
    naming its URL."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    wanted = {name: key for key, name in SPEC_COUNTERS.items()}
    for url in urls:
        for sample in _samples(url, timeout_s, "--worker-metrics: cannot read {url} ({error})"):
            if sample.name in wanted:
                totals[wanted[sample.name]] += sample.value
    return SpecCounts(**totals)


def _samples(url: str, timeout_s: float, unreachable: str):
    """Every sample of the Prometheus exposition at `url`; ValueError with `unreachable`
    (formatted with url and error) when it cannot be read."""
    try:
        body = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    except OSError as e:
        raise ValueError(unreachable.format(url=url, error=e)) from e
    return [sample for family in text_string_to_metric_families(body) for sample in family.samples]


def spec_summary(before: SpecCounts, after: SpecCounts) -> dict:
    """The run's speculative decoding: acceptance rate = accepted / proposed; mean accepted
    length = accepted draft tokens per verification (each verification also yields one
    token of the target's own, so tokens per step there are this + 1)."""
    proposed = after.proposed - before.proposed
    accepted = after.accepted - before.accepted
    verifications = after.verifications - before.verifications
    return {"proposed_tokens": int(proposed), "accepted_tokens": int(accepted), "verifications": int(verifications),
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": accepted / verifications if verifications else None}


# services/router/metrics.py: RouterMetrics.paths, labelled (path, reason)
PATH_DECISIONS = "pdserve_router_path_decisions_total"


def scrape_path_decisions(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The router's requests by path and reason ("direct/prefill_pool_busy": n); an
    unreachable router raises ValueError naming its URL."""
    return {f"{s.labels['path']}/{s.labels['reason']}": s.value
            for s in _samples(url, timeout_s, "cannot read the router's metrics at {url} ({error})")
            if s.name == PATH_DECISIONS}


def decisions_during(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The decisions a run added, by path/reason, the ones it did not use left out."""
    return {key: int(n - before.get(key, 0.0)) for key, n in sorted(after.items()) if n > before.get(key, 0.0)}
