"""The PromQL prometheus-adapter sends for the chart's per-pod rules.

The chart renders the adapter's rules (deploy/helm/pdserve/templates/adapter-rules.yaml,
ConfigMap key config.yaml). When an HPA asks for a pod metric, prometheus-adapter fills
the rule's `metricsQuery` (a Go template with `<<` `>>` delimiters) with:

    <<.Series>>         the series the rule matched, e.g. pdserve_worker_ttft_seconds_bucket
    <<.LabelMatchers>>  namespace="llm",pod="a"    (one pod)
                        namespace="llm",pod=~"a|b"  (several: one regex alternation)
    <<.GroupBy>>        pod

(prometheus-adapter pkg/naming/metrics_query.go, `Build`: the namespace matcher first,
then the resource's, values quoted with Go's %q, joined by commas). This module does the
same, so tests can ask a real Prometheus the exact query an HPA's metric comes from, and
a local autoscaler can read its pods' metric the way the adapter would.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

# A Kubernetes object name (DNS-1123 subdomain): such values need no escaping inside %q.
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_SERIES_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_ACTION = re.compile(r"<<\s*\.(\w+)\s*>>")
_FIELDS = ("Series", "LabelMatchers", "GroupBy")


@dataclass(frozen=True)
class AdapterRule:
    """One rule of the adapter's config: the metric it serves and how it is computed."""
    metric: str          # name.as: the name the HPA asks custom.metrics.k8s.io for
    series: str          # the one series name.matches accepts (<<.Series>>)
    metrics_query: str   # the Go template
    resource_labels: dict[str, str]  # Kubernetes resource -> Prometheus label (overrides)

    def pod_query(self, namespace: str, pods: list[str]) -> str:
        """The query prometheus-adapter sends for these pods of `namespace`."""
        return render(self.metrics_query, self.series,
                      label_matchers(self.resource_labels["namespace"], namespace, self.resource_labels["pod"], pods),
                      group_by=self.resource_labels["pod"])


def parse_rules(config_yaml: str) -> list[AdapterRule]:
    """The rules of an adapter config.yaml (the chart's ConfigMap data)."""
    doc = yaml.safe_load(config_yaml) or {}
    rules = doc.get("rules")
    if not isinstance(rules, list):
        raise ValueError("adapter config: `rules` must be a list")
    return [_parse_rule(i, r) for i, r in enumerate(rules)]


def _parse_rule(i: int, rule: dict) -> AdapterRule:
    where = f"adapter config: rules[{i}]"
    name = rule.get("name") or {}
    matches = str(name.get("matches", ""))
    series = matches.removeprefix("^").removesuffix("$")
    if not _SERIES_NAME.match(series):
        raise ValueError(f"{where}.name.matches: {matches!r} is not one literal series name (^name$)")
    if not name.get("as"):
        raise ValueError(f"{where}.name.as: missing")
    overrides = ((rule.get("resources") or {}).get("overrides")) or {}
    labels = {str(v.get("resource")): label for label, v in overrides.items() if isinstance(v, dict)}
    for resource in ("namespace", "pod"):
        if resource not in labels:
            raise ValueError(f"{where}.resources.overrides: no label maps to the {resource} resource")
    if not rule.get("metricsQuery"):
        raise ValueError(f"{where}.metricsQuery: missing")
    return AdapterRule(metric=str(name["as"]), series=series, metrics_query=str(rule["metricsQuery"]),
                       resource_labels=labels)


def label_matchers(namespace_label: str, namespace: str, pod_label: str, pods: list[str]) -> str:
    """<<.LabelMatchers>> for a per-pod query: `pod="a"` for one pod, `pod=~"a|b"` for more."""
    _check_name("namespace", namespace)
    if not pods:
        raise ValueError("pods: at least one pod name is needed")
    for pod in pods:
        _check_name("pods", pod)
    op = "=" if len(pods) == 1 else "=~"
    return f'{namespace_label}="{namespace}",{pod_label}{op}"{"|".join(pods)}"'


def render(template: str, series: str, label_matchers: str, group_by: str) -> str:
    """Fill a metricsQuery template: every `<<.Field>>` is one of Series, LabelMatchers,
    GroupBy; anything else is refused (the adapter's other fields are maps and slices)."""
    values = {"Series": series, "LabelMatchers": label_matchers, "GroupBy": group_by}

    def fill(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ValueError(f"metricsQuery: <<.{m.group(1)}>> is not supported (only {', '.join(_FIELDS)})")
        return values[m.group(1)]

    query = _ACTION.sub(fill, template)
    if "<<" in query or ">>" in query:
        raise ValueError(f"metricsQuery: a template action other than <<.Field>> is left in {query!r}")
    return query


def _check_name(field: str, value: str) -> None:
    if not _K8S_NAME.match(value):
        raise ValueError(f"{field}: {value!r} is not a Kubernetes object name")
