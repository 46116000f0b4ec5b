import math

import pytest

from pdserve.cli.bench.arrivals import ArrivalConfig, schedule


def test_poisson_mean_rate_with_a_seeded_rng():
    offsets = schedule(ArrivalConfig("poisson", rate=20.0, seed=3), 4000)
    assert len(offsets) == 4000 and offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(20.0, rel=0.05)
    assert offsets == schedule(ArrivalConfig("poisson", rate=20.0, seed=3), 4000)
    assert offsets != schedule(ArrivalConfig("poisson", rate=20.0, seed=4), 4000)


def test_constant_rate_and_infinite_rate():
    assert schedule(ArrivalConfig("constant", rate=4.0), 5) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert schedule(ArrivalConfig("poisson", rate=math.inf), 3) == [0.0, 0.0, 0.0]


def test_bursts_schedule_constant():
    cfg = ArrivalConfig("burst", rate=0.0, burst_rate=10.0, on_s=0.5, off_s=1.5, burst_poisson=False)
    offsets = schedule(cfg, 12)
    assert offsets == pytest.approx([0, 0.1, 0.2, 0.3, 0.4, 2.0, 2.1, 2.2, 2.3, 2.4, 4.0, 4.1])


def test_bursts_schedule_with_background_rate():
    cfg = ArrivalConfig("burst", rate=2.0, burst_rate=10.0, on_s=1.0, off_s=1.0, burst_poisson=False)
    offsets = schedule(cfg, 12)
    assert offsets == pytest.approx([0, .1, .2, .3, .4, .5, .6, .7, .8, .9, 1.0, 1.5])


def test_poisson_bursts_rates_per_phase():
    cfg = ArrivalConfig("burst", rate=1.0, burst_rate=30.0, on_s=1.0, off_s=3.0, seed=1)
    offsets = schedule(cfg, 5000)
    on = sum(1 for t in offsets if t % 4.0 < 1.0)
    periods = offsets[-1] / 4.0
    assert on / periods == pytest.approx(30.0, rel=0.1)
    assert (len(offsets) - on) / periods == pytest.approx(3.0, rel=0.15)


def test_trace_times_are_scaled():
    assert schedule(ArrivalConfig("trace", time_scale=0.5), 3, [0.0, 1.0, 4.0]) == [0.0, 0.5, 2.0]
    with pytest.raises(ValueError):
        schedule(ArrivalConfig("trace"), 2, [0.0, None])


def test_bad_configs_are_refused():
    for kw in ({"process": "nope"}, {"rate": -1.0}, {"process": "burst", "burst_rate": 0.0},
               {"max_concurrency": 0}):
        with pytest.raises(ValueError):
            ArrivalConfig(**kw)
