"""The day study: the HPA follows the diurnal load, static provisioning pays for the peak."""
import pytest

from pdserve.sim.autoscale import Curve, Study, calibrate, chart_specs, hpa_day, static_day
from pdserve.sim.diurnal import DiurnalConfig, requests
from tests.sim.helpers import flat_profile

# a pool whose worker keeps its metric under 0.2 s and its requests in SLO up to 10 req/s
CURVE = Curve((0.0, 5.0, 10.0, 12.0), (0.1, 0.15, 0.2, 5.0), (1.0, 1.0, 1.0, 0.0))
DAY = DiurnalConfig(peak_rps=1000.0, trough_rps=100.0)


def test_diurnal_rate_and_arrivals():
    assert DAY.rate(4 * 3600) == pytest.approx(100.0) and DAY.rate(16 * 3600) == pytest.approx(1000.0)
    hour = requests(DiurnalConfig(peak_rps=10.0, trough_rps=10.0), 0.0, 100.0)
    assert 800 < len(hour) < 1200 and all(a.arrival_s <= b.arrival_s for a, b in zip(hour, hour[1:]))


def test_hpa_uses_fewer_replica_hours_than_static_at_equal_attainment():
    study = Study(sync_s=60.0)  # coarser than the controller's 15 s: a fast test
    specs = chart_specs(study, prefill_target_s=0.2, decode_target_s=0.2)
    hpa = hpa_day(DAY, (CURVE, CURVE), specs, study)
    assert hpa.attainment > 0.9
    assert 100 <= hpa.peak_prefill <= 140  # 1000 req/s at up to 10 per worker, with the metric's tolerance
    p, d, att = static_day(DAY, (CURVE, CURVE), hpa.attainment, study)
    assert att >= hpa.attainment
    assert hpa.replica_hours < (p + d) * 24


def test_static_for_the_peak_is_the_fewest_workers_that_carry_it():
    p, d, att = static_day(DAY, (CURVE, CURVE), 1.0, Study(), at_peak=True)
    assert (p, d, att) == (100, 100, 1.0)


def test_calibration_runs_the_simulator_and_saturates():
    day = DiurnalConfig(input_median=200, input_max=400, output_median=20, output_max=40)
    prefill, decode = calibrate(flat_profile(), day, Study(calibration_s=3.0, slo_ttft_s=0.15, slo_tpot_s=0.2, grid=(0.2, 1.0, 1.5)))
    assert prefill.metric[-1] > prefill.metric[0] and decode.metric[-1] >= decode.metric[0]
    assert prefill.share[0] == 1.0 and prefill.share[-1] < 1.0
