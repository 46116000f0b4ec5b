"""The probe's calibration recovers a machine's speed and overheads."""
from dataclasses import replace

import pytest

from pdserve.profiler.calibrate import NeighbourProbe, ProbeResult, calibrate
from pdserve.sim.profile import Table1D
from tests.sim.helpers import flat_profile


def probe_of(machine, short=64, long=256, request=0.03, handoff=0.02, disaggregated=True):
    """What the probe would see on a machine whose steps cost `machine`'s."""
    gap = machine.decode_step_s(1, 76)
    read = machine.kv_get(short * machine.kv_bytes_per_token) if disaggregated else 0.0
    first_gap = gap + (handoff + read if disaggregated else 0.0)
    # a longer prompt's hand-off: its longer write and read on top
    first_gap_long = first_gap + machine.handoff_s(long) - machine.handoff_s(short) if disaggregated else 0.0
    return ProbeResult(short, long, request + machine.prefill_s(short), request + machine.prefill_s(long),
                       gap, first_gap, 76, first_gap_long)


def test_a_slower_machine_and_its_overheads_are_recovered():
    profile = replace(flat_profile(), prefill=Table1D((0.0, 512.0), (0.1, 3.0)))
    now = profile.scaled(1.3, 0.8, 3.0)  # prefill 30% slower, decode 20% faster, KV 3x as slow as profiled
    cal = calibrate(profile, probe_of(now), disaggregated=True)
    assert cal.prefill_factor == pytest.approx(1.3) and cal.decode_factor == pytest.approx(0.8)
    assert cal.kv_factor == pytest.approx(3.0)
    assert cal.request_overhead_s == pytest.approx(0.03) and cal.handoff_overhead_s == pytest.approx(0.02)
    fitted = cal.apply(profile)
    assert fitted.prefill_s(300) == pytest.approx(now.prefill_s(300))
    assert fitted.decode_step_s(4, 1000) == pytest.approx(now.decode_step_s(4, 1000))
    assert fitted.step_overhead_s == 0.0 and fitted.handoff_overhead_s == pytest.approx(0.02)
    assert fitted.handoff_s(1000) == pytest.approx(now.handoff_s(1000))
    assert fitted.neighbour_prefill_factor == fitted.neighbour_decode_factor == 1.0  # no neighbour probe


def test_the_neighbour_probe_gives_how_much_two_busy_workers_slow_each_other():
    profile = replace(flat_profile(), prefill=Table1D((0.0, 512.0), (0.1, 3.0)))
    probe = probe_of(profile, request=0.03)
    lone_prefill = probe.ttft_long_s - 0.03
    beside = NeighbourProbe(gap_alone_s=0.12, gap_beside_prefill_s=0.18, ttft_beside_decode_s=0.03 + 1.2 * lone_prefill)
    cal = calibrate(profile, probe, disaggregated=True, neighbours=beside)
    assert cal.neighbour_decode_factor == pytest.approx(1.5)
    assert cal.neighbour_prefill_factor == pytest.approx(1.2)
    fitted = cal.apply(profile)
    assert (fitted.neighbour_prefill_factor, fitted.neighbour_decode_factor) == pytest.approx((1.2, 1.5))
    # a beside-gap under the lone one is noise: a neighbour never speeds a step up
    faster = replace(beside, gap_beside_prefill_s=0.10)
    assert calibrate(profile, probe, disaggregated=True, neighbours=faster).neighbour_decode_factor == 1.0
    with pytest.raises(ValueError, match="gap_alone_s"):
        calibrate(profile, probe, disaggregated=True, neighbours=replace(beside, gap_alone_s=0.0))


def test_colocated_has_no_handoff_and_bad_probes_are_refused():
    profile = flat_profile()
    assert calibrate(profile, probe_of(profile, disaggregated=False), disaggregated=False).handoff_overhead_s == 0.0
    with pytest.raises(ValueError, match="long_tokens"):
        calibrate(profile, probe_of(profile, short=64, long=64), disaggregated=True)
    backwards = replace(probe_of(profile), ttft_long_s=0.001)
    with pytest.raises(ValueError, match="must exceed"):
        calibrate(profile, backwards, disaggregated=True)
    with pytest.raises(ValueError, match="scale factors"):
        profile.scaled(0.0, 1.0)
    with pytest.raises(ValueError, match="first gap"):
        calibrate(profile, replace(probe_of(profile), first_gap_long_s=0.001), disaggregated=True)
