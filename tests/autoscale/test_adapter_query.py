"""prometheus-adapter's metricsQuery templating (autoscale/adapter_query.py), as
its Build does it: namespace matcher first, `pod="a"` for one pod, `pod=~"a|b"` for more,
GroupBy the pod label. tests/services/test_prometheus.py runs the results on Prometheus."""
from __future__ import annotations

import pytest

from pdserve.autoscale.adapter_query import label_matchers, parse_rules, render
from tests.deploy.chart import FULLNAME, render as render_chart

RULE = """
rules:
  - seriesQuery: 'x_seconds_bucket{namespace!="",pod!=""}'
    resources:
      overrides:
        kubernetes_namespace: {resource: namespace}
        kubernetes_pod: {resource: pod}
    name: {matches: "^x_seconds_bucket$", as: "x_p90"}
    metricsQuery: histogram_quantile(0.9, sum(rate(<<.Series>>{<<.LabelMatchers>>}[1m])) by (le, <<.GroupBy>>))
"""


def test_one_pod_and_several_pods():
    (rule,) = parse_rules(RULE)
    assert (rule.metric, rule.series) == ("x_p90", "x_seconds_bucket")
    assert rule.pod_query("llm", ["p-0"]) == (
        'histogram_quantile(0.9, sum(rate(x_seconds_bucket{kubernetes_namespace="llm",kubernetes_pod="p-0"}[1m]))'
        ' by (le, kubernetes_pod))')
    assert label_matchers("namespace", "llm", "pod", ["a", "b"]) == 'namespace="llm",pod=~"a|b"'


def test_the_charts_rules_render_to_complete_queries():
    rules = parse_rules(render_chart().get("ConfigMap", f"{FULLNAME}-adapter-rules")["data"]["config.yaml"])
    assert {r.series for r in rules} == {"pdserve_worker_ttft_seconds_bucket", "pdserve_worker_itl_seconds_bucket"}
    for r in rules:
        query = r.pod_query("llm", ["w-0", "w-1"])
        assert "<<" not in query and f'{r.series}{{namespace="llm",pod=~"w-0|w-1"}}' in query
        assert query.count('{namespace="llm",pod=~"w-0|w-1"}') == 2 and "by (pod)" in query


def test_bad_input_is_refused_by_name():
    (rule,) = parse_rules(RULE)
    with pytest.raises(ValueError, match="pods"):
        rule.pod_query("llm", [])
    with pytest.raises(ValueError, match="pods: 'a\"b'"):
        rule.pod_query("llm", ['a"b'])
    with pytest.raises(ValueError, match="namespace: 'LLM'"):
        rule.pod_query("LLM", ["a"])
    with pytest.raises(ValueError, match="LabelValuesByName"):
        render("<<.LabelValuesByName>>", "s", "m", "g")
    with pytest.raises(ValueError, match="template action"):
        render("<<range .GroupBySlice>>x<<end>>", "s", "m", "g")
    with pytest.raises(ValueError, match=r"rules\[0\].name.matches"):
        parse_rules(RULE.replace('"^x_seconds_bucket$"', '"^(.*)_bucket$"'))
    with pytest.raises(ValueError, match=r"rules\[0\].resources.overrides: no label maps to the pod"):
        parse_rules(RULE.replace("{resource: pod}", "{resource: node}"))
    with pytest.raises(ValueError, match="`rules`"):
        parse_rules("rules: 3")
