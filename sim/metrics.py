"""The simulated run's summary, under the bench client's definitions (cli/bench/metrics.py):
TTFT from arrival to the first token, ITL the gaps between tokens, TPOT (e2e - TTFT) /
(output tokens - 1), goodput the requests meeting both SLOs per second of the run."""
from __future__ import annotations

import math

import numpy as np

from pdserve.sim.cluster import SimRequest

PERCENTILES = (50, 90, 99)


def _pcts(values) -> dict:
    v = np.asarray(values, dtype=float)
    return {f"p{p}": (float(np.percentile(v, p)) if v.size else None) for p in PERCENTILES}


def summarize(requests: list[SimRequest], overhead_s: float = 0.0, slo_ttft_s: float = math.inf,
              slo_tpot_s: float = math.inf, num_workers: int = 1) -> dict:
    done = [r for r in requests if not r.rejected and r.first_s is not None]
    ttft = [r.first_s - r.arrival_s + overhead_s for r in done]
    itl = [g for r in done for g in r.itls]
    tpot = [(r.last_s - r.first_s) / (r.num_output - 1) for r in done if r.num_output > 1]
    good = sum(1 for r, t in zip(done, ttft)
               if t <= slo_ttft_s and (r.num_output <= 1 or (r.last_s - r.first_s) / (r.num_output - 1) <= slo_tpot_s))
    start = min((r.arrival_s for r in requests), default=0.0)
    duration = max((r.end_s for r in requests if r.end_s is not None), default=start) - start
    return {"completed": len(done), "rejected": sum(r.rejected for r in requests), "duration_s": duration,
            "ttft_s": _pcts(ttft), "itl_s": _pcts(itl), "tpot_s": _pcts(tpot),
            "slo_attainment": good / len(requests) if requests else 0.0,
            "goodput_rps": good / duration if duration > 0 else 0.0,
            "goodput_rps_per_worker": good / duration / num_workers if duration > 0 else 0.0}


def format_summary(s: dict, label: str = "sim") -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"
    lines = [f"{label}: {s['completed']} completed, {s['rejected']} rejected, {s['duration_s']:.1f} s",
             "            p50      p90      p99   (ms)"]
    for name in ("ttft_s", "itl_s", "tpot_s"):
        d = s[name]
        lines.append(f"  {name[:-2].upper():<6} {ms(d['p50']):>8} {ms(d['p90']):>8} {ms(d['p99']):>8}")
    lines.append(f"  SLO attainment {s['slo_attainment'] * 100:.1f}%, goodput {s['goodput_rps']:.2f} req/s "
                 f"({s['goodput_rps_per_worker']:.3f} per worker)")
    return "\n".join(lines)
