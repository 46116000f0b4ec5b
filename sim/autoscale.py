"""HPA on TTFT / ITL against static provisioning for the peak, over a day at cluster scale.

A step-level simulation of a day at hundreds of workers is hundreds of millions of
engine steps: too slow in Python. The day is composed instead from short discrete-event
runs (sim/cluster.py, the router's own code), mean-field style:

1. calibrate: each pool alone under load (the other pool generously sized), at a grid of
   per-worker request rates: the pods' metric the HPA reads (TTFT p90 for prefill, ITL p90
   for decode, as the chart's prometheus-adapter rules) and the share of requests meeting
   the TTFT SLO (prefill pool) and the TPOT SLO (decode pool). With load balanced over
   alike workers, a pool of N at total rate R behaves as its workers do at R/N each.
2. the day (simulated twice, the second counted: the first brings the replicas from
   minReplicas to the curve): every HPA sync (15 s) the rate is the diurnal curve's; each pool's per-pod
   metric is its calibrated value at the last 2 minutes' per-ready-pod rate; the HPA
   (autoscale/hpa.py, the controller's own arithmetic, the chart's behavior)
   sets the replicas; a new pod serves after `startup_s`; SLO attainment is the product
   of the pools' shares; replica-hours count every pod, starting ones too.
3. static: the fewest prefill + decode workers whose day attainment is at least the
   HPA run's (equal SLO attainment), and the fewest that meet it at the peak.
4. `--check-s`: one full discrete-event run of the whole cluster (hundreds of workers) at
   the peak for that many seconds, against the calibrated prediction.

    .venv/bin/python -m pdserve.sim.autoscale [--profile sim/profiles/h100_llama8b.json] [--check-s 10]
"""
from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, replace

import numpy as np
import yaml

from pdserve.autoscale.chart_values import CHART_VALUES
from pdserve.autoscale.hpa import HPA, HPASpec, load_hpa_specs
from pdserve.services.router.decide.config import PathConfig, RoutingConfig, SaturationConfig
from pdserve.sim.cluster import ClusterConfig, simulate
from pdserve.sim.diurnal import DAY_S, DiurnalConfig, lengths, requests
from pdserve.sim.metrics import summarize
from pdserve.sim.profile import Profile, load_profile



def pooled_router(profile: Profile) -> RoutingConfig:
    """Every prompt through the prefill pool, so the pools' loads are separable (step 1);
    the router lets a worker hold as many requests as its engine batches (its default of
    64 in flight would cap a GPU worker with max_num_seqs 256)."""
    return RoutingConfig(paths=PathConfig(policy="threshold"), short_prompt_tokens=0,
                         saturation=SaturationConfig(max_in_flight_per_worker=profile.scheduler.max_num_seqs))
GRID = (0.1, 0.3, 0.5, 0.65, 0.8, 0.9, 1.0, 1.1, 1.25)


@dataclass(frozen=True)
class Study:
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    startup_s: float = 120.0       # a GPU pod's start: image, model load, warm-up
    sync_s: float = 15.0           # kube-controller-manager's HPA sync period
    window_s: float = 120.0        # the metric's window (the chart's 2m)
    calibration_s: float = 30.0    # simulated seconds per calibration point
    calibration_workers: int = 2
    max_replicas: int = 1000
    grid: tuple[float, ...] = GRID  # per-worker rates to calibrate at, as fractions of a guessed capacity


@dataclass(frozen=True)
class Curve:
    """A pool's calibration: by per-worker rate, the HPA metric and the SLO share."""
    rates: tuple[float, ...]
    metric: tuple[float, ...]
    share: tuple[float, ...]

    def at(self, rate: np.ndarray | float):
        return (np.interp(rate, self.rates, self.metric), np.interp(rate, self.rates, self.share, right=0.0))


def capacity_guess(profile: Profile, day: DiurnalConfig) -> tuple[float, float]:
    """Rough requests/s one prefill and one decode worker sustain (where the grid centres)."""
    import random
    rng = random.Random(1)
    sample = [lengths(day, rng) for _ in range(2000)]
    lim = profile.scheduler
    budget = lim.max_num_batched_tokens
    prefill_s = np.mean([math.ceil(i / budget) * profile.prefill_s(min(i, budget)) for i, _ in sample])
    mean_out = np.mean([o for _, o in sample])
    mean_ctx = np.mean([i + o / 2 for i, o in sample])
    batch = lim.max_num_seqs
    decode_rps = batch / (mean_out * profile.decode_step_s(batch, mean_ctx))
    return 1 / prefill_s, decode_rps


def _constant(day: DiurnalConfig, rate: float, seconds: float, seed: int):
    flat = replace(day, peak_rps=rate, trough_rps=rate, seed=seed)
    return requests(flat, 0.0, seconds)


def calibrate(profile: Profile, day: DiurnalConfig, study: Study) -> tuple[Curve, Curve]:
    cap_p, cap_d = capacity_guess(profile, day)
    k = study.calibration_workers
    pools = []
    for pool, cap in (("prefill", cap_p), ("decode", cap_d)):
        rates, metric, share = [], [], []
        for i, f in enumerate(study.grid):
            trace = _constant(day, f * cap * k, study.calibration_s, seed=1000 + i)
            # the pool under study has k workers, the other enough never to be the bottleneck
            num_p, num_d = (k, max(k, math.ceil(4 * f * cap * k / cap_d))) if pool == "prefill" else \
                (max(k, math.ceil(4 * f * cap * k / cap_p)), k)
            reqs = simulate(trace, profile, ClusterConfig(num_p, num_d, pooled_router(profile)))
            s = summarize(reqs, profile.request_overhead_s)
            rates.append(f * cap)
            if pool == "prefill":
                metric.append(s["ttft_s"]["p90"] or 0.0)
                ok = [r for r in reqs if not r.rejected and r.first_s is not None
                      and r.first_s - r.arrival_s + profile.request_overhead_s <= study.slo_ttft_s]
            else:
                metric.append(s["itl_s"]["p90"] or 0.0)
                ok = [r for r in reqs if not r.rejected and r.end_s is not None and r.first_s is not None and
                      (r.num_output <= 1 or (r.last_s - r.first_s) / (r.num_output - 1) <= study.slo_tpot_s)]
            share.append(len(ok) / len(reqs))
        pools.append(Curve(tuple(rates), tuple(metric), tuple(share)))
    return pools[0], pools[1]


@dataclass
class DayResult:
    replica_hours: float
    attainment: float
    peak_prefill: int
    peak_decode: int
    timeline: list  # (t, rate, prefill pods, decode pods)


def hpa_day(day: DiurnalConfig, curves: tuple[Curve, Curve], specs: dict[str, HPASpec], study: Study) -> DayResult:
    hpas = {pool: HPA(spec) for pool, spec in specs.items()}
    pods = {pool: [0.0] * specs[pool].min_replicas for pool in specs}  # each pod's ready time
    history: list[float] = []
    hours = good = total = 0.0
    peak = {pool: 0 for pool in specs}
    timeline = []
    num_ticks = int(DAY_S / study.sync_s)
    for tick in range(2 * num_ticks):  # the first day only brings the replicas to the curve
        t = tick * study.sync_s
        rate = day.rate(t)
        history = (history + [rate])[-max(1, int(study.window_s / study.sync_s)):]
        shares = 1.0
        for pool, curve in zip(("prefill", "decode"), curves):
            ready = sum(1 for r in pods[pool] if r <= t)
            metric, share = curve.at(np.mean(history) / max(ready, 1))
            shares *= float(curve.at(rate / max(ready, 1))[1])
            decision = hpas[pool].decide(t, len(pods[pool]), [float(metric)] * ready)
            if decision.desired > len(pods[pool]):
                pods[pool] += [t + study.startup_s] * (decision.desired - len(pods[pool]))
            elif decision.desired < len(pods[pool]):
                pods[pool] = sorted(pods[pool])[:decision.desired]  # the newest go first
            if tick >= num_ticks:
                peak[pool] = max(peak[pool], len(pods[pool]))
        if tick < num_ticks:
            continue
        n = len(pods["prefill"]) + len(pods["decode"])
        hours += n * study.sync_s / 3600
        good += rate * study.sync_s * shares
        total += rate * study.sync_s
        if tick % 240 == 0:
            timeline.append((t - DAY_S, rate, len(pods["prefill"]), len(pods["decode"])))
    return DayResult(hours, good / total, peak["prefill"], peak["decode"], timeline)


def static_day(day: DiurnalConfig, curves: tuple[Curve, Curve], target: float, study: Study,
               at_peak: bool = False) -> tuple[int, int, float]:
    """The fewest (prefill, decode) workers whose attainment (over the day, or at the peak)
    reaches `target`; and that attainment."""
    ts = np.arange(0.0, DAY_S, study.sync_s)
    rates = np.array([day.peak_rps]) if at_peak else np.array([day.rate(t) for t in ts])
    def attainment(share_p, d: int) -> float:
        return float(np.sum(rates * share_p * curves[1].at(rates / d)[1]) / rates.sum())

    best = None
    for p in range(1, study.max_replicas):
        if best is not None and p + 1 > best[0] + best[1]:
            break
        share_p = curves[0].at(rates / p)[1]
        if attainment(share_p, study.max_replicas) < target:
            continue
        lo, hi = 1, study.max_replicas  # attainment grows with d: the fewest d that reach the target
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if attainment(share_p, mid) >= target else (mid + 1, hi)
        if best is None or p + lo < best[0] + best[1]:
            best = (p, lo, attainment(share_p, lo))
    if best is None:
        raise ValueError(f"no static provisioning up to {study.max_replicas} workers reaches {target:.3f}")
    return best


def chart_specs(study: Study, prefill_target_s: float | None, decode_target_s: float | None) -> dict[str, HPASpec]:
    with open(CHART_VALUES, encoding="utf-8") as f:
        specs = load_hpa_specs(yaml.safe_load(f))
    targets = {"prefill": prefill_target_s, "decode": decode_target_s}
    return {pool: replace(s, max_replicas=study.max_replicas, target=targets[pool] or s.target)
            for pool, s in specs.items()}


def check_at_scale(profile: Profile, day: DiurnalConfig, curves, num_p: int, num_d: int, seconds: float) -> dict:
    """One discrete-event run of the whole cluster at the peak rate, against the calibration."""
    trace = _constant(day, day.peak_rps, seconds, seed=7)
    start = time.perf_counter()
    reqs = simulate(trace, profile, ClusterConfig(num_p, num_d, pooled_router(profile)))
    s = summarize(reqs, profile.request_overhead_s)
    return {"workers": (num_p, num_d), "requests": len(trace), "wall_s": time.perf_counter() - start,
            "des_ttft_p90": s["ttft_s"]["p90"], "des_itl_p90": s["itl_s"]["p90"],
            "calibrated_ttft_p90": float(curves[0].at(day.peak_rps / num_p)[0]),
            "calibrated_itl_p90": float(curves[1].at(day.peak_rps / num_d)[0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=os.path.join(os.path.dirname(__file__), "profiles", "h100_llama8b.json"))
    p.add_argument("--peak-rps", type=float, default=DiurnalConfig.peak_rps)
    p.add_argument("--trough-rps", type=float, default=DiurnalConfig.trough_rps)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--prefill-target-ms", type=float, default=None, help="HPA target (default: the chart's)")
    p.add_argument("--decode-target-ms", type=float, default=None, help="HPA target (default: the chart's)")
    p.add_argument("--startup-s", type=float, default=Study.startup_s)
    p.add_argument("--check-s", type=float, default=0.0, help="full-cluster DES check at the peak (0: none)")
    a = p.parse_args()
    study = Study(a.slo_ttft_ms / 1000, a.slo_tpot_ms / 1000, a.startup_s)
    day = DiurnalConfig(a.peak_rps, a.trough_rps)
    profile = load_profile(a.profile)
    t0 = time.perf_counter()
    curves = calibrate(profile, day, study)
    print(f"profile: {profile.source}\ncalibrated in {time.perf_counter() - t0:.1f} s")
    for name, c in zip(("prefill TTFT p90", "decode ITL p90"), curves):
        print(f"  {name}: " + ", ".join(f"{r:.1f} rps/worker -> {m * 1000:.0f} ms ({s * 100:.0f}% in SLO)"
                                        for r, m, s in zip(c.rates, c.metric, c.share)))
    specs = chart_specs(study, a.prefill_target_ms and a.prefill_target_ms / 1000,
                        a.decode_target_ms and a.decode_target_ms / 1000)
    hpa = hpa_day(day, curves, specs, study)
    sp, sd, s_att = static_day(day, curves, hpa.attainment, study)
    pp, pd, p_att = static_day(day, curves, hpa.attainment, study, at_peak=True)
    num_requests = sum(day.rate(t) * 60 for t in range(0, 86400, 60))
    print(f"day: diurnal {a.trough_rps:g}..{a.peak_rps:g} req/s, {num_requests / 1e6:.0f}M "
          f"requests; SLO TTFT <= {a.slo_ttft_ms:g} ms, TPOT <= {a.slo_tpot_ms:g} ms; HPA targets prefill "
          f"{specs['prefill'].target * 1000:g} ms TTFT p90, decode {specs['decode'].target * 1000:g} ms ITL p90")
    print("| provisioning | prefill | decode | replica-hours | SLO attainment |\n|---|---:|---:|---:|---:|")
    print(f"| HPA (chart behavior, {a.startup_s:g} s pod start) | {hpa.peak_prefill} (peak) | {hpa.peak_decode} (peak) "
          f"| {hpa.replica_hours:.0f} | {hpa.attainment * 100:.2f}% |")
    print(f"| static, equal day attainment | {sp} | {sd} | {(sp + sd) * 24:.0f} | {s_att * 100:.2f}% |")
    print(f"| static for the peak (attainment at peak >= HPA's day) | {pp} | {pd} | {(pp + pd) * 24:.0f} "
          f"| {p_att * 100:.2f}% at peak |")
    print("HPA pods every hour (h: rate, prefill, decode): " + "; ".join(
        f"{t / 3600:.0f}: {r:.0f}, {np_}, {nd}" for t, r, np_, nd in hpa.timeline))
    if a.check_s > 0:
        print(f"full-cluster DES check: {check_at_scale(profile, day, curves, pp, pd, a.check_s)}")


if __name__ == "__main__":
    main()
