"""One definition: the HPAs helm renders from the chart's values and the specs the local
controller (`pdserve up --autoscale`) loads from the same values agree, field by field."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdserve.autoscale.hpa import (DEFAULT_SCALE_DOWN, DEFAULT_SCALE_UP, HPASpec, ScalingPolicy, ScalingRules,
                                   load_hpa_specs)
from tests.deploy.chart import FULLNAME, VALUES, Manifests, _merge, render, render_text, values

TESTS_CLI = Path(__file__).resolve().parents[1] / "cli"
# each override file a `pdserve up --autoscale` test takes, with one value it sets
TEST_VALUES = {"autoscale_values.yaml": ("prefill", 5), "autoscale_decode_values.yaml": ("decode", 12)}
AUTOSCALED = [n for n in VALUES if values(n)["prefill"]["autoscaling"]["enabled"]]


def quantity(text) -> float:
    """A Kubernetes quantity as the chart writes averageValue ("500m", "2")."""
    text = str(text)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def rules(rendered: dict | None, default: ScalingRules) -> ScalingRules:
    """behavior.scaleUp/scaleDown as the API server defaults it."""
    if rendered is None:
        return default
    policies = rendered.get("policies")
    return ScalingRules(float(rendered.get("stabilizationWindowSeconds", default.stabilization_window_s)),
                        rendered.get("selectPolicy", "Max"),
                        default.policies if policies is None else
                        tuple(ScalingPolicy(p["type"], p["value"], float(p["periodSeconds"])) for p in policies))


def spec_of(hpa: dict) -> HPASpec:
    s = hpa["spec"]
    (metric,) = s["metrics"]
    behavior = s.get("behavior") or {}
    return HPASpec(s["minReplicas"], s["maxReplicas"], quantity(metric["pods"]["target"]["averageValue"]),
                   rules(behavior.get("scaleUp"), DEFAULT_SCALE_UP),
                   rules(behavior.get("scaleDown"), DEFAULT_SCALE_DOWN))


def rendered_specs(m: Manifests) -> dict[str, HPASpec]:
    return {pool: spec_of(m.get("HorizontalPodAutoscaler", f"{FULLNAME}-{pool}")) for pool in ("prefill", "decode")}


@pytest.mark.parametrize("name", AUTOSCALED)
def test_the_rendered_hpas_are_the_specs_the_local_controller_loads(name):
    assert rendered_specs(render(name)) == load_hpa_specs(values(name))


@pytest.mark.parametrize("file_name", sorted(TEST_VALUES))
def test_the_test_overrides_render_and_agree_too(file_name):
    """The short windows `pdserve up --autoscale-values` takes in tests are valid chart values."""
    path = TESTS_CLI / file_name
    m = Manifests([d for d in yaml.safe_load_all(render_text(extra_files=(path,))) if d])
    merged = values()
    _merge(merged, yaml.safe_load(path.read_text()))
    specs = load_hpa_specs(merged)
    assert rendered_specs(m) == specs
    pool, window_s = TEST_VALUES[file_name]
    assert specs[pool].scale_down.stabilization_window_s == window_s  # the override, not the chart's 300
