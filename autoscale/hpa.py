"""Kubernetes' HorizontalPodAutoscaler replica calculation, for one Pods metric with an
AverageValue target (what the chart's HPAs use), as kube-controller-manager computes it.

One sync (`HPA.decide`):

    pod metrics ──▶ ratio = mean / target ──▶ raw = ceil(ratio × pods with data)
                    (|1 - ratio| <= tolerance: raw = current; pods without data count
                     as the target on a scale-down and as 0 on a scale-up)
    raw ──▶ stabilize: max of the recommendations of the last scaleDown window,
                       min of those of the last scaleUp window, current in between
        ──▶ rate limit: each policy allows a change relative to the replicas at the
            start of its period (current − scale-ups + scale-downs inside it);
            selectPolicy Max takes the policy allowing the most change, Min the
            least, Disabled none
        ──▶ clamp to [minReplicas, maxReplicas]                  ──▶ desired

The controller records every change it makes (a scale event) for the rate limit, and
every raw recommendation for the stabilization windows. `decide()` records its own
scale event when it returns desired != current (the caller is expected to apply it, as
the Deployment's scale subresource would); `record_scale()` is for changes made by
something else. `load_hpa_specs` reads the chart's values, the one definition of the
targets and windows both the chart and `pdserve up --autoscale` use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

POOLS = ("prefill", "decode")
SELECT_POLICIES = ("Max", "Min", "Disabled")
POLICY_TYPES = ("Pods", "Percent")


@dataclass(frozen=True)
class ScalingPolicy:
    """One entry of behavior.scaleUp/scaleDown.policies."""
    type: str  # "Pods" | "Percent"
    value: int
    period_s: float


@dataclass(frozen=True)
class ScalingRules:
    """behavior.scaleUp or behavior.scaleDown."""
    stabilization_window_s: float
    select_policy: str  # "Max" | "Min" | "Disabled"
    policies: tuple[ScalingPolicy, ...]


@dataclass(frozen=True)
class HPASpec:
    """One pool's HPA, as the chart renders it."""
    min_replicas: int
    max_replicas: int
    target: float  # AverageValue target of the per-pod metric (seconds)
    scale_up: ScalingRules
    scale_down: ScalingRules
    tolerance: float = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance


@dataclass(frozen=True)
class Decision:
    time_s: float
    current: int
    desired: int  # after tolerance, stabilization, policies, min/max
    raw: int  # ceil(current * metric / target) before them
    metric: float | None  # the averaged per-pod metric (None: no data)
    reason: str  # short human text: "within tolerance", "scale-up limited by policy Pods=2/60s", ...


# Kubernetes' defaults for a behavior section that leaves keys out (autoscaling/v2).
DEFAULT_SCALE_UP = ScalingRules(0.0, "Max", (ScalingPolicy("Pods", 4, 15.0), ScalingPolicy("Percent", 100, 15.0)))
DEFAULT_SCALE_DOWN = ScalingRules(300.0, "Max", (ScalingPolicy("Percent", 100, 15.0),))


@dataclass(frozen=True)
class _Event:
    time_s: float
    value: int  # a recommendation, or a replica change (always positive)


class HPA:
    """Kubernetes' HPA replica calculation for one Pods-type metric with an AverageValue
    target, stateful like the controller (recommendation history, scale events)."""

    def __init__(self, spec: HPASpec):
        self.spec = spec
        self._recommendations: list[_Event] = []
        self._scale_ups: list[_Event] = []
        self._scale_downs: list[_Event] = []
        self._seen = False

    def decide(self, now_s: float, current_replicas: int, pod_metrics: list[float]) -> Decision:
        """One sync: `pod_metrics` holds the values of the pods that reported one; a pod
        of `current_replicas` missing from it has no data (starting, or not scraped)."""
        spec = self.spec
        if not self._seen:  # like the controller on a new HPA: the current count is a recommendation
            self._seen = True
            self._recommendations.append(_Event(now_s, current_replicas))
        metric = sum(pod_metrics) / len(pod_metrics) if pod_metrics else None
        if current_replicas == 0 and spec.min_replicas > 0:  # Kubernetes: a target at 0 is left alone
            return Decision(now_s, 0, 0, 0, metric, "scaling disabled: 0 replicas")
        if current_replicas > spec.max_replicas:  # outside the range: no metric needed
            return self._apply(Decision(now_s, current_replicas, spec.max_replicas, current_replicas, metric,
                                        "current above maxReplicas"))
        if current_replicas < spec.min_replicas:
            return self._apply(Decision(now_s, current_replicas, spec.min_replicas, current_replicas, metric,
                                        "current below minReplicas"))
        if not pod_metrics:  # the controller does not scale on no data
            return Decision(now_s, current_replicas, current_replicas, current_replicas, None, "no metrics")
        raw, why = self._raw(current_replicas, pod_metrics)
        stabilized = self._stabilize(now_s, current_replicas, raw)
        desired, limit = self._limit(now_s, current_replicas, stabilized)
        reason = limit or (why if stabilized == raw else f"{why}; {_stabilized(raw, stabilized, current_replicas)}")
        return self._apply(Decision(now_s, current_replicas, desired, raw, metric, reason))

    def record_scale(self, now_s: float, old: int, new: int) -> None:
        """A change of the replica count, counted by the policies' periods."""
        if new > old:
            self._scale_ups.append(_Event(now_s, new - old))
        elif new < old:
            self._scale_downs.append(_Event(now_s, old - new))

    def _apply(self, decision: Decision) -> Decision:
        self.record_scale(decision.time_s, decision.current, decision.desired)
        return decision

    # -- 1. the metric's recommendation ---------------------------------------------------

    def _raw(self, current: int, pod_metrics: list[float]) -> tuple[int, str]:
        """replica_calculator's plain-metric path: ratio over the pods with data, then the
        pods without data re-added conservatively, with the tolerance applied to both."""
        target, tolerance = self.spec.target, self.spec.tolerance
        ratio = sum(pod_metrics) / len(pod_metrics) / target
        num_missing = max(0, current - len(pod_metrics))
        if num_missing == 0:
            if abs(1.0 - ratio) <= tolerance:
                return current, "within tolerance"
            return math.ceil(ratio * len(pod_metrics)), _direction(ratio)
        # missing pods: the target on a scale-down, 0 on a scale-up (never amplify the move)
        filled = list(pod_metrics) + [target if ratio < 1.0 else 0.0] * num_missing
        new_ratio = sum(filled) / len(filled) / target
        if abs(1.0 - new_ratio) <= tolerance or (ratio < 1.0) != (new_ratio < 1.0):
            return current, "within tolerance (pods without data counted conservatively)"
        raw = math.ceil(new_ratio * len(filled))
        if (new_ratio < 1.0 and raw > current) or (new_ratio > 1.0 and raw < current):
            return current, "direction reversed by pods without data"
        return raw, _direction(new_ratio) + " (pods without data counted conservatively)"

    # -- 2. stabilization ------------------------------------------------------------------

    def _stabilize(self, now_s: float, current: int, raw: int) -> int:
        """Scale up only to the lowest, down only to the highest recommendation of the
        respective window: a short spike or dip moves nothing."""
        up_cutoff = now_s - self.spec.scale_up.stabilization_window_s
        down_cutoff = now_s - self.spec.scale_down.stabilization_window_s
        up, down = raw, raw
        for rec in self._recommendations:
            if rec.time_s > up_cutoff:
                up = min(up, rec.value)
            if rec.time_s > down_cutoff:
                down = max(down, rec.value)
        # forget what no window can see any more, keep this sync's raw recommendation
        oldest = min(up_cutoff, down_cutoff)
        self._recommendations = [r for r in self._recommendations if r.time_s > oldest]
        self._recommendations.append(_Event(now_s, raw))
        return min(max(current, up), down)

    # -- 3. rate limits and bounds ---------------------------------------------------------

    def _limit(self, now_s: float, current: int, desired: int) -> tuple[int, str]:
        spec = self.spec
        if desired > current:
            limit, policy = self._scale_up_limit(now_s, current)
            limit = max(limit, current)  # events still in their period: no further growth
            if limit < spec.max_replicas and desired > limit:
                return limit, f"scale-up limited by policy {policy}"
            if desired > spec.max_replicas:
                return spec.max_replicas, "capped at maxReplicas"
        elif desired < current:
            limit, policy = self._scale_down_limit(now_s, current)
            limit = min(limit, current)
            if limit > spec.min_replicas and desired < limit:
                return limit, f"scale-down limited by policy {policy}"
            if desired < spec.min_replicas:
                return spec.min_replicas, "floored at minReplicas"
        return desired, ""

    def _scale_up_limit(self, now_s: float, current: int) -> tuple[int, str]:
        rules = self.spec.scale_up
        if rules.select_policy == "Disabled":
            return current, "Disabled"
        proposals = []
        for p in rules.policies:
            start = self._period_start(now_s, current, p.period_s)
            allowed = start + p.value if p.type == "Pods" else math.ceil(start * (1 + p.value / 100))
            proposals.append((allowed, p))
        pick = max if rules.select_policy == "Max" else min  # Max: the most change
        allowed, p = pick(proposals, key=lambda t: t[0])
        return allowed, _name(p)

    def _scale_down_limit(self, now_s: float, current: int) -> tuple[int, str]:
        rules = self.spec.scale_down
        if rules.select_policy == "Disabled":
            return current, "Disabled"
        proposals = []
        for p in rules.policies:
            start = self._period_start(now_s, current, p.period_s)
            allowed = start - p.value if p.type == "Pods" else math.floor(start * (1 - p.value / 100))
            proposals.append((allowed, p))
        pick = min if rules.select_policy == "Max" else max  # Max: the most change = the fewest pods
        allowed, p = pick(proposals, key=lambda t: t[0])
        return allowed, _name(p)

    def _period_start(self, now_s: float, current: int, period_s: float) -> int:
        """The replica count at the start of the policy's period."""
        cutoff = now_s - period_s
        added = sum(e.value for e in self._scale_ups if e.time_s > cutoff)
        removed = sum(e.value for e in self._scale_downs if e.time_s > cutoff)
        return current - added + removed


def _stabilized(raw: int, stabilized: int, current: int) -> str:
    window = "scale-down" if raw < current else "scale-up"
    if stabilized == current:
        return f"held at {current} by the {window} stabilization window"
    return f"{stabilized} after the {window} stabilization window"


def _direction(ratio: float) -> str:
    return f"metric {'above' if ratio > 1 else 'below'} target (ratio {ratio:.2f})"


def _name(p: ScalingPolicy) -> str:
    return f"{p.type}={p.value}/{p.period_s:g}s"


# -- the chart's values -------------------------------------------------------------------


def load_hpa_specs(values: dict) -> dict[str, HPASpec]:
    """{"prefill": HPASpec, "decode": HPASpec} from the chart's values (values.yaml's
    <pool>.autoscaling sections), the one definition both the chart and the local
    controller use. A pool whose autoscaling is disabled has no HPA and is left out."""
    specs = {}
    for pool in POOLS:
        section = _get(values, f"{pool}.autoscaling", dict)
        if _get(section, "enabled", bool, f"{pool}.autoscaling"):
            specs[pool] = _spec(section, f"{pool}.autoscaling")
    return specs


def _spec(a: dict, where: str) -> HPASpec:
    lo = _get(a, "minReplicas", int, where)
    hi = _get(a, "maxReplicas", int, where)
    if lo < 1 or hi < lo:
        raise ValueError(f"{where}.minReplicas/maxReplicas: need 1 <= minReplicas <= maxReplicas, got {lo}, {hi}")
    target_s = _get(a, "metric.targetSeconds", (int, float), where)
    if target_s <= 0:
        raise ValueError(f"{where}.metric.targetSeconds: must be > 0, got {target_s}")
    # the chart renders averageValue in milli-units ("500m"): the HPA sees the rounded value
    target = round(target_s * 1000) / 1000
    behavior = a.get("behavior") or {}
    if not isinstance(behavior, dict):
        raise ValueError(f"{where}.behavior: must be a mapping, got {behavior!r}")
    return HPASpec(lo, hi, target,
                   _rules(behavior.get("scaleUp"), DEFAULT_SCALE_UP, f"{where}.behavior.scaleUp"),
                   _rules(behavior.get("scaleDown"), DEFAULT_SCALE_DOWN, f"{where}.behavior.scaleDown"))


def _rules(r: dict | None, default: ScalingRules, where: str) -> ScalingRules:
    if r is None:
        return default
    if not isinstance(r, dict):
        raise ValueError(f"{where}: must be a mapping, got {r!r}")
    window = r.get("stabilizationWindowSeconds", default.stabilization_window_s)
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window <= 3600:
        raise ValueError(f"{where}.stabilizationWindowSeconds: must be a number in [0, 3600], got {window!r}")
    select = r.get("selectPolicy", "Max")
    if select not in SELECT_POLICIES:
        raise ValueError(f"{where}.selectPolicy: must be one of {SELECT_POLICIES}, got {select!r}")
    raw_policies = r.get("policies")
    if raw_policies is None:
        return ScalingRules(float(window), select, default.policies)
    if not isinstance(raw_policies, list) or not raw_policies:
        raise ValueError(f"{where}.policies: must be a non-empty list")
    return ScalingRules(float(window), select,
                        tuple(_policy(p, f"{where}.policies[{i}]") for i, p in enumerate(raw_policies)))


def _policy(p: dict, where: str) -> ScalingPolicy:
    if not isinstance(p, dict):
        raise ValueError(f"{where}: must be a mapping, got {p!r}")
    kind = p.get("type")
    if kind not in POLICY_TYPES:
        raise ValueError(f"{where}.type: must be one of {POLICY_TYPES}, got {kind!r}")
    value = _get(p, "value", int, where)
    period = _get(p, "periodSeconds", (int, float), where)
    if value <= 0 or not 0 < period <= 1800:
        raise ValueError(f"{where}: value must be > 0 and periodSeconds in (0, 1800], got {value}, {period}")
    return ScalingPolicy(kind, value, float(period))


def _get(d: dict, dotted: str, kind, where: str = ""):
    """d[a][b]... with an error naming the missing or mistyped field."""
    node = d
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"{where + '.' if where else ''}{dotted}: missing")
        node = node[key]
    if isinstance(node, bool) and kind is not bool or not isinstance(node, kind):
        raise ValueError(f"{where + '.' if where else ''}{dotted}: wrong type, got {node!r}")
    return node
