"""Kubernetes' HPA algorithm, one rule per test, each with a case the rule changes."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.autoscale.hpa import HPA, HPASpec, ScalingPolicy, ScalingRules, load_hpa_specs

VALUES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve" / "values.yaml"
FREE = ScalingRules(0.0, "Max", (ScalingPolicy("Pods", 100, 15.0),))  # no window, no practical limit


def spec(lo=1, hi=100, target=1.0, up=FREE, down=FREE, tolerance=0.1) -> HPASpec:
    return HPASpec(lo, hi, target, up, down, tolerance)


def test_raw_is_ceil_of_current_times_metric_over_target():
    d = HPA(spec(target=0.5)).decide(0, 2, [1.0, 1.1])  # mean 1.05 -> ratio 2.1 -> ceil(4.2)
    assert (d.raw, d.desired, d.metric) == (5, 5, pytest.approx(1.05))


def test_ratio_within_tolerance_keeps_the_count():
    assert HPA(spec()).decide(0, 10, [1.09] * 10).desired == 10  # ceil(10.9) = 11 without tolerance
    assert HPA(spec()).decide(0, 10, [1.11] * 10).desired == 12
    assert HPA(spec(tolerance=0.0)).decide(0, 10, [1.05] * 10).desired == 11
    assert HPA(spec()).decide(0, 10, [0.91] * 10).reason == "within tolerance"


def test_scale_down_takes_the_highest_recommendation_of_its_window():
    hpa = HPA(spec(down=ScalingRules(60.0, "Max", (ScalingPolicy("Percent", 100, 15.0),))))
    assert hpa.decide(0, 4, [1.0] * 4).desired == 4
    assert hpa.decide(10, 4, [0.5] * 4).desired == 4  # raw 2, but 4 was recommended 10 s ago
    d = hpa.decide(30, 4, [0.25] * 4)
    assert (d.raw, d.desired) == (1, 4) and d.reason.endswith("held at 4 by the scale-down stabilization window")
    d = hpa.decide(61, 4, [0.25] * 4)  # the 4 left the window; the 2 at t=10 did not
    assert d.desired == 2 and d.reason.endswith("2 after the scale-down stabilization window")
    assert hpa.decide(71, 2, [0.5] * 2).desired == 1


def test_scale_up_takes_the_lowest_recommendation_of_its_window():
    hpa = HPA(spec(up=ScalingRules(30.0, "Max", (ScalingPolicy("Pods", 100, 15.0),))))
    assert hpa.decide(0, 2, [1.0, 1.0]).desired == 2
    assert hpa.decide(10, 2, [3.0, 3.0]).desired == 2  # the 2 from t=0 is still in the window
    assert hpa.decide(20, 2, [2.0, 2.0]).desired == 2
    assert hpa.decide(31, 2, [3.0, 3.0]).desired == 4  # lowest of {6 (t=10), 4 (t=20), 6}
    assert hpa.decide(41, 4, [1.5] * 4).desired == 4  # the 4 of t=20 still holds it
    assert hpa.decide(51, 4, [1.5] * 4).desired == 6


def test_a_pods_policy_limits_growth_per_period_from_the_period_start():
    hpa = HPA(spec(up=ScalingRules(0.0, "Max", (ScalingPolicy("Pods", 2, 60.0),))))
    d = hpa.decide(0, 1, [8.0])
    assert (d.raw, d.desired, d.reason) == (8, 3, "scale-up limited by policy Pods=2/60s")
    assert hpa.decide(10, 3, [8.0] * 3).desired == 3  # the period started at 1: 1 + 2 already reached
    assert hpa.decide(61, 3, [8.0] * 3).desired == 5  # the first scale-up left the period


def test_a_percent_policy_limits_growth_and_rounds_up():
    hpa = HPA(spec(up=ScalingRules(0.0, "Max", (ScalingPolicy("Percent", 50, 60.0),))))
    assert hpa.decide(0, 3, [10.0] * 3).desired == 5  # ceil(3 * 1.5)
    down = HPA(spec(down=ScalingRules(0.0, "Max", (ScalingPolicy("Percent", 50, 60.0),))))
    assert down.decide(0, 5, [0.01] * 5).desired == 2  # floor(5 * 0.5)


@pytest.mark.parametrize("select, expected", [("Max", 8), ("Min", 6)])
def test_select_policy_picks_the_most_or_the_least_change_up(select, expected):
    rules = ScalingRules(0.0, select, (ScalingPolicy("Pods", 2, 60.0), ScalingPolicy("Percent", 100, 60.0)))
    assert HPA(spec(up=rules)).decide(0, 4, [10.0] * 4).desired == expected


@pytest.mark.parametrize("select, expected", [("Max", 4), ("Min", 7)])
def test_select_policy_picks_the_most_or_the_least_change_down(select, expected):
    rules = ScalingRules(0.0, select, (ScalingPolicy("Pods", 1, 60.0), ScalingPolicy("Percent", 50, 60.0)))
    assert HPA(spec(down=rules)).decide(0, 8, [0.01] * 8).desired == expected


def test_disabled_direction_never_moves():
    off = ScalingRules(0.0, "Disabled", (ScalingPolicy("Pods", 1, 15.0),))
    assert HPA(spec(down=off)).decide(0, 4, [0.01] * 4).desired == 4
    assert HPA(spec(up=off)).decide(0, 4, [10.0] * 4).desired == 4
    assert HPA(spec(up=off)).decide(0, 4, [0.01] * 4).desired == 1  # the other direction still works


def test_min_and_max_replicas_bound_the_result():
    d = HPA(spec(lo=2, hi=8)).decide(0, 4, [10.0] * 4)
    assert (d.raw, d.desired, d.reason) == (40, 8, "capped at maxReplicas")
    d = HPA(spec(lo=2, hi=8)).decide(0, 4, [0.0] * 4)
    assert (d.raw, d.desired, d.reason) == (0, 2, "floored at minReplicas")
    assert HPA(spec(lo=2, hi=8)).decide(0, 10, [1.0] * 10).desired == 8  # above max: back to max
    assert HPA(spec(lo=2, hi=8)).decide(0, 1, []).desired == 2  # below min: up to min, no metric needed


def test_the_policy_limit_comes_before_max_in_the_reason():
    hpa = HPA(spec(hi=4, up=ScalingRules(0.0, "Max", (ScalingPolicy("Pods", 1, 60.0),))))
    assert hpa.decide(0, 1, [10.0]).reason == "scale-up limited by policy Pods=1/60s"


def test_a_pool_at_zero_is_left_alone():
    assert HPA(spec(lo=1)).decide(0, 0, []).desired == 0  # as the controller: scaled to 0 by hand


def test_no_metrics_no_change():
    d = HPA(spec()).decide(0, 3, [])
    assert (d.desired, d.metric, d.reason) == (3, None, "no metrics")


def test_pods_without_data_damp_a_scale_up_and_a_scale_down():
    # 2 of 4 pods report 3x the target, the 2 silent ones count 0: mean 1.5 -> 6 (not 4 * 3 = 12)
    d = HPA(spec()).decide(0, 4, [3.0, 3.0])
    assert (d.raw, d.desired) == (6, 6)
    # on a scale-down the silent ones count the target: mean 0.6 -> 3 (not 1)
    assert HPA(spec()).decide(0, 4, [0.2, 0.2]).desired == 3
    # mean 0.75, filled [1.5, 0, 1, 1] -> 0.875 -> ceil(3.5) = 4: nothing to do (not 2)
    assert HPA(spec()).decide(0, 4, [1.5, 0.0]).desired == 4


def test_the_first_sync_counts_the_current_count_as_a_recommendation():
    hpa = HPA(spec(down=ScalingRules(60.0, "Max", (ScalingPolicy("Pods", 10, 15.0),))))
    assert hpa.decide(0, 4, [0.1] * 4).desired == 4  # a restarted controller does not drop at once
    assert hpa.decide(61, 4, [0.1] * 4).desired == 1


def test_scale_events_made_elsewhere_count_against_the_policy():
    hpa = HPA(spec(up=ScalingRules(0.0, "Max", (ScalingPolicy("Pods", 2, 60.0),))))
    hpa.record_scale(0, 1, 3)
    assert hpa.decide(10, 3, [10.0] * 3).desired == 3


# -- the chart's values -------------------------------------------------------------------


def chart_values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def test_load_hpa_specs_reads_the_charts_values():
    values = chart_values()
    specs = load_hpa_specs(values)
    a = values["prefill"]["autoscaling"]
    p = specs["prefill"]
    assert (p.min_replicas, p.max_replicas, p.target) == (a["minReplicas"], a["maxReplicas"],
                                                          a["metric"]["targetSeconds"])
    up = a["behavior"]["scaleUp"]
    assert p.scale_up.stabilization_window_s == up["stabilizationWindowSeconds"]
    assert p.scale_up.select_policy == up["selectPolicy"]
    assert [(x.type, x.value, x.period_s) for x in p.scale_up.policies] == \
        [(x["type"], x["value"], x["periodSeconds"]) for x in up["policies"]]
    assert specs["decode"].target == values["decode"]["autoscaling"]["metric"]["targetSeconds"]


def test_load_hpa_specs_fills_kubernetes_defaults_and_skips_disabled_pools():
    values = chart_values()
    del values["prefill"]["autoscaling"]["behavior"]
    values["decode"]["autoscaling"]["enabled"] = False
    specs = load_hpa_specs(values)
    assert set(specs) == {"prefill"}
    assert specs["prefill"].scale_down.stabilization_window_s == 300
    assert [(x.type, x.value) for x in specs["prefill"].scale_up.policies] == [("Pods", 4), ("Percent", 100)]


def test_load_hpa_specs_rounds_the_target_like_the_charts_milli_units():
    values = chart_values()
    values["prefill"]["autoscaling"]["metric"]["targetSeconds"] = 0.1234
    assert load_hpa_specs(values)["prefill"].target == 0.123


@pytest.mark.parametrize("path, value, field", [
    (("prefill", "autoscaling", "minReplicas"), 0, "prefill.autoscaling.minReplicas"),
    (("decode", "autoscaling", "maxReplicas"), "8", "decode.autoscaling.maxReplicas"),
    (("prefill", "autoscaling", "metric", "targetSeconds"), -1, "prefill.autoscaling.metric.targetSeconds"),
    (("prefill", "autoscaling", "behavior", "scaleUp", "selectPolicy"), "Fastest",
     "prefill.autoscaling.behavior.scaleUp.selectPolicy"),
    (("decode", "autoscaling", "behavior", "scaleDown", "policies"), [{"type": "Replicas", "value": 1,
                                                                       "periodSeconds": 60}],
     "decode.autoscaling.behavior.scaleDown.policies[0].type"),
    (("decode", "autoscaling", "behavior", "scaleDown", "stabilizationWindowSeconds"), 7200,
     "decode.autoscaling.behavior.scaleDown.stabilizationWindowSeconds"),
])
def test_bad_values_name_the_field(path, value, field):
    values = chart_values()
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("[", r"\[")):
        load_hpa_specs(values)
