"""The local HPA controller: every sync period, for each autoscaled pool, read the pods'
metric, run Kubernetes' replica calculation (hpa.py) and set the pool's size.

    every sync_period_s:  pods' /metrics ─▶ PodMetricSource ─▶ HPA.decide ─▶ log line
                                                                         └─▶ scaler.scale(pool, desired)

What a "pool" is lives behind `PoolScaler`: `pdserve up --autoscale` starts worker
processes and drains them (cli/autoscale.py); a test can use a fake. As in a cluster,
`replicas` counts the pods asked for (starting and serving, not those draining), and only
pods that serve report a metric (a starting pod counts as one without data).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.autoscale.hpa import HPA, Decision, HPASpec, load_hpa_specs
from pdserve.autoscale.pod_metrics import MetricSpec, PodMetricSource, fetch, metric_specs

SYNC_PERIOD_S = 15.0  # kube-controller-manager's --horizontal-pod-autoscaler-sync-period


class PoolScaler(ABC):
    """The pools' scale subresource, as the HPA controller sees it."""

    @abstractmethod
    def replicas(self, pool: str) -> int:
        """Pods asked for: starting or serving (not draining)."""

    @abstractmethod
    def metrics_urls(self, pool: str) -> list[str]:
        """The /metrics URL of each serving pod of the pool."""

    @abstractmethod
    def scale(self, pool: str, replicas: int) -> None:
        """Start pods or drain them until `replicas` are asked for."""


@dataclass(frozen=True)
class PoolAutoscaling:
    hpa: HPASpec
    metric: MetricSpec


def pools_from_values(values: dict) -> dict[str, PoolAutoscaling]:
    """Each autoscaled pool's HPA and metric, from the chart's values (the one definition)."""
    hpas, metrics = load_hpa_specs(values), metric_specs(values)
    return {pool: PoolAutoscaling(hpas[pool], metrics[pool]) for pool in hpas}


def format_decision(pool: str, d: Decision, target: float) -> str:
    metric = "none" if d.metric is None else f"{d.metric:.3f}"
    return (f"autoscale t={d.time_s:.1f}s pool={pool} current={d.current} metric={metric} target={target:.3f} "
            f"raw={d.raw} desired={d.desired} reason={d.reason}")


class Autoscaler:
    def __init__(self, pools: dict[str, PoolAutoscaling], scaler: PoolScaler, sync_period_s: float = SYNC_PERIOD_S,
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                 fetch_text: Callable[[str], str] = fetch):
        if sync_period_s <= 0:
            raise ValueError(f"sync_period_s: must be > 0, got {sync_period_s}")
        self.pools, self.scaler, self.sync_period_s = pools, scaler, sync_period_s
        self._log, self._clock = log, clock
        self._hpas = {pool: HPA(p.hpa) for pool, p in pools.items()}
        self._sources = {pool: PodMetricSource(p.metric, fetch_text) for pool, p in pools.items()}
        self._start = clock()
        self._next_sync = self._start
        self.decisions: list[tuple[str, Decision]] = []

    def tick(self) -> None:
        """Sync when a period has passed; call it often (it returns at once otherwise)."""
        now = self._clock()
        if now >= self._next_sync:
            self._next_sync = now + self.sync_period_s
            self.sync(now)

    def sync(self, now: float) -> None:
        t = now - self._start
        for pool, hpa in self._hpas.items():
            current = self.scaler.replicas(pool)
            values = self._sources[pool].observe(t, self.scaler.metrics_urls(pool))
            decision = hpa.decide(t, current, list(values.values()))
            self.decisions.append((pool, decision))
            self._log(format_decision(pool, decision, self.pools[pool].hpa.target))
            if decision.desired != current:
                self.scaler.scale(pool, decision.desired)
