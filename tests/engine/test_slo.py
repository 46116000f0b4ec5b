"""SLOTargets: the one form a request's latency targets take in the engine, and the one
conversion from and to the wire's milliseconds (services/common/convert.py)."""
from __future__ import annotations

import math

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.slo import NO_SLO, SLOTargets
from pdserve.services.common.convert import slo_from_proto, slo_to_proto
from pdserve.services.pb import common_pb2


@pytest.mark.parametrize("field", ["ttft_budget_s", "min_class_ttft_s", "itl_target_s"])
@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf, True, "1"])
def test_a_bad_target_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequestError, match=rf"^slo\.{field}: "):
        SLOTargets(**{field: value}).validate()
    NO_SLO.validate()
    SLOTargets(1.5, 0.25, 0.05).validate()


def test_spent_takes_from_the_ttft_budget_alone_and_never_below_none():
    slo = SLOTargets(ttft_budget_s=4.0, min_class_ttft_s=6.0, itl_target_s=0.05)
    assert slo.spent(1.5) == SLOTargets(2.5, 6.0, 0.05)
    assert slo.spent(9.0).ttft_budget_s == 0.0
    assert NO_SLO.spent(3.0) == NO_SLO  # none given stays none


def test_milliseconds_on_the_wire_seconds_in_the_engine_both_ways():
    slo = SLOTargets(ttft_budget_s=2.5, min_class_ttft_s=1.0, itl_target_s=0.125)
    msg = slo_to_proto(slo)
    assert (msg.ttft_budget_ms, msg.min_class_ttft_ms, msg.itl_target_ms) == (2500.0, 1000.0, 125.0)
    assert slo_from_proto(msg) == slo
    assert slo_from_proto(common_pb2.SLOTargets()) == NO_SLO


@pytest.mark.parametrize("field", ["ttft_budget_ms", "min_class_ttft_ms", "itl_target_ms"])
def test_a_bad_wire_value_is_refused_in_the_wires_names(field):
    with pytest.raises(InvalidRequestError, match=rf"^slo\.{field}: must be a finite number >= 0"):
        slo_from_proto(common_pb2.SLOTargets(**{field: -1.0}))
