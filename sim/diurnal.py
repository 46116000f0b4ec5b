"""A synthetic day of traffic: a diurnal request rate and request lengths, for the
autoscaling study. Documented shape, no real data:

    rate(t) = trough + (peak - trough) * (1 - cos(2 pi (t - trough_at) / 24 h)) / 2

lowest at `trough_at` (04:00 by default), highest twelve hours later (16:00); arrivals
are Poisson at that rate. Prompt and output lengths are lognormal (median, sigma),
clamped, each request with its own hash ids (no shared prefixes).

    .venv/bin/python -m pdserve.sim.diurnal --out day.jsonl --peak-rps 20 --trough-rps 2 [--hours 24]
"""
from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass

from pdserve.sim.trace import TRACE_BLOCK_SIZE, TraceRequest, write_trace

DAY_S = 86400.0


@dataclass(frozen=True)
class DiurnalConfig:
    peak_rps: float = 3000.0
    trough_rps: float = 300.0
    trough_at_s: float = 4 * 3600.0
    input_median: int = 1024
    input_sigma: float = 0.8
    input_max: int = 8192
    output_median: int = 128
    output_sigma: float = 0.7
    output_max: int = 1024
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.trough_rps <= self.peak_rps or self.peak_rps <= 0:
            raise ValueError(f"diurnal: need 0 <= trough_rps <= peak_rps, peak > 0; got {self.trough_rps}, "
                             f"{self.peak_rps}")

    def rate(self, t_s: float) -> float:
        phase = 2 * math.pi * (t_s - self.trough_at_s) / DAY_S
        return self.trough_rps + (self.peak_rps - self.trough_rps) * (1 - math.cos(phase)) / 2


def lengths(cfg: DiurnalConfig, rng: random.Random) -> tuple[int, int]:
    n_in = min(cfg.input_max, max(1, round(rng.lognormvariate(math.log(cfg.input_median), cfg.input_sigma))))
    n_out = min(cfg.output_max, max(1, round(rng.lognormvariate(math.log(cfg.output_median), cfg.output_sigma))))
    return n_in, n_out


def requests(cfg: DiurnalConfig, start_s: float, end_s: float) -> list[TraceRequest]:
    """Poisson arrivals in [start_s, end_s) (thinning against the peak rate)."""
    rng = random.Random(f"{cfg.seed}/{start_s}")
    out, t, next_hash = [], start_s, int(start_s * 1000) * 64
    while True:
        t += rng.expovariate(cfg.peak_rps)
        if t >= end_s:
            return out
        if rng.random() * cfg.peak_rps <= cfg.rate(t):
            n_in, n_out = lengths(cfg, rng)
            num_blocks = -(-n_in // TRACE_BLOCK_SIZE)
            out.append(TraceRequest(t, n_in, n_out, tuple(range(next_hash, next_hash + num_blocks))))
            next_hash += num_blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--peak-rps", type=float, default=20.0)
    p.add_argument("--trough-rps", type=float, default=2.0)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    reqs = requests(DiurnalConfig(a.peak_rps, a.trough_rps, seed=a.seed), 0.0, a.hours * 3600)
    write_trace(a.out, reqs)
    print(f"wrote {a.out}: {len(reqs)} requests")


if __name__ == "__main__":
    main()
