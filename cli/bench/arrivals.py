"""When each request is sent: offsets in seconds from the start of the run.

- poisson / constant: `rate` requests/s (inf: all at once, max concurrency decides);
- burst: on/off periods, `burst_rate` during the `on_s` seconds of each period and
  `rate` (may be 0) during the `off_s` seconds, Poisson or evenly spaced inside each;
- trace: the dataset's own timestamps, times `time_scale`.
The schedule has exactly one offset per request, so a run always ends."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PROCESSES = ("poisson", "constant", "burst", "trace")


@dataclass(frozen=True)
class ArrivalConfig:
    process: str = "poisson"
    rate: float = math.inf           # requests/s (burst: the rate between bursts)
    burst_rate: float = 0.0          # burst: requests/s while on
    on_s: float = 1.0
    off_s: float = 1.0
    burst_poisson: bool = True       # burst: Poisson inside the periods, else evenly spaced
    time_scale: float = 1.0          # trace: multiply the trace's times
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.process not in PROCESSES:
            raise ValueError(f"arrivals: {self.process!r} is not one of {', '.join(PROCESSES)}")
        if self.rate < 0 or self.burst_rate < 0 or self.on_s < 0 or self.off_s < 0 or self.time_scale < 0:
            raise ValueError("arrivals: rates and durations must not be negative")
        if self.process == "burst" and not (0 < self.burst_rate < math.inf and self.on_s > 0):
            raise ValueError("arrivals: burst needs a finite --burst-rate > 0 and --burst-on-s > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("arrivals: max concurrency must be at least 1")


def _rate_process(n: int, rate: float, poisson: bool, rng: np.random.Generator) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("arrivals: the request rate must be positive")
    gaps = rng.exponential(1.0 / rate, n) if poisson else np.full(n, 1.0 / rate)
    gaps[0] = 0.0  # the first request goes at once
    return [float(t) for t in np.cumsum(gaps)]


def _piecewise(n: int, rate_at, period_s: float, on_s: float, poisson: bool, rng: np.random.Generator,
               ) -> list[float]:
    """A process whose rate is rate_at(True) in the first on_s seconds of every period and
    rate_at(False) in the rest. Poisson: arrivals after Exp(1) units of rate-weighted time;
    constant: each phase sends at its start + j/rate, j = 0, 1, ... while inside the phase.
    The first arrival is at 0."""
    out: list[float] = []
    t, budget = 0.0, 0.0  # Poisson: rate-weighted time still to pass before the next arrival
    for _ in range(1_000_000):  # bounded: every period sends at least one request on average
        for on, length in ((True, on_s), (False, period_s - on_s)):
            rate, end = rate_at(on), t + length
            if rate > 0 and not poisson:
                j = 0
                while t + j / rate < end - 1e-9:
                    out.append(t + j / rate)
                    j += 1
                    if len(out) >= n:
                        return out
            elif rate > 0:
                while t + budget / rate < end:
                    t += budget / rate
                    out.append(t)
                    if len(out) >= n:
                        return out
                    budget = rng.exponential(1.0)
                budget -= (end - t) * rate
            t = end
    raise ValueError("arrivals: the schedule did not fill within a million periods")


def schedule(cfg: ArrivalConfig, n: int, trace_times: list[float | None] | None = None) -> list[float]:
    """n send offsets (s), non-decreasing, the first at 0 (a trace's first at its own 0)."""
    rng = np.random.default_rng(cfg.seed)
    if cfg.process == "trace":
        if trace_times is None or len(trace_times) != n or any(t is None for t in trace_times):
            raise ValueError("arrivals: 'trace' needs a dataset with timestamps (mooncake)")
        return [float(t) * cfg.time_scale for t in trace_times]
    if cfg.process in ("poisson", "constant"):
        return _rate_process(n, cfg.rate, cfg.process == "poisson", rng)
    rates = {True: cfg.burst_rate, False: cfg.rate if not math.isinf(cfg.rate) else 0.0}
    return _piecewise(n, rates.__getitem__, cfg.on_s + cfg.off_s, cfg.on_s, cfg.burst_poisson, rng)
