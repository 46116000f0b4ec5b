"""Goodput: at rising request rates, the share of requests meeting a TTFT *and* a TPOT
SLO on a mixed short/long workload, for each way of serving it on the same cores, and the
highest rate at which at least 90% meet it.

The platforms are real processes, each worker pinned to its own core: `adaptive` is the
default `pdserve up` (1 prefill + 1 decode worker, the router choosing each request's path
from the workers' measured rates, issue 13), `threshold` the same workers with the fixed
rule (prompts <= --short-prompt-tokens direct), `colocated` 2 workers without a prefill
pool (chunked prefill on), `both` 2 workers of both roles (`pdserve up --both 2`: each
prefills long prompts for the other, short ones go direct; adaptive paths). The router's default SLO class is given the bench's SLO, as an
operator would configure it. For each rate the script writes one Mooncake-format
trace (Poisson arrivals; a --long-share of prompts uniform in --long-len ± 25%, the rest
uniform in --short-len ± 75%; outputs uniform in --output-len ± 50%) and replays the same
trace against each mode (`--arrival trace`). A mode's sweep stops after the first rate
where fewer than half the requests meet the SLO. Prints one JSON line: per mode and rate
the goodput share and rate, TTFT/TPOT p50/p99, then each mode's highest rate up to which
every tested rate had >= 90% goodput, its ratio to colocated, and the requests by path
(and by path/reason, from the router's own counters).

    .venv/bin/python -m bench.serve_goodput [--model smollm2 --rates 0.25,0.5,0.75,1.0,1.5
        --duration-s 60 --slo-ttft-ms 5000 --slo-tpot-ms 150 --result-dir /tmp/pdserve-bench/goodput]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

from bench.report import emit_result, emit_row, ratios
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.metrics import SLO, RequestRecord, meets_slo
from pdserve.cli.bench.targets import TargetConfig
from pdserve.cli.bench.worker_metrics import decisions_during, scrape_path_decisions
from pdserve.cli.launcher import PlatformConfig

# (prefill workers, decode workers, workers of both roles, path policy)
MODES = {"adaptive": (1, 1, 0, "adaptive"), "threshold": (1, 1, 0, "threshold"), "colocated": (0, 2, 0, "colocated"),
         "both": (0, 0, 2, "adaptive")}
TARGET_SHARE = 0.9


def write_trace(path: str, rate: float, args) -> int:
    """A mixed-length Poisson trace of about --duration-s at `rate`; returns its length."""
    rng = np.random.default_rng(args.seed)
    n = max(args.min_requests, round(rate * args.duration_s))
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    is_long = rng.random(n) < args.long_share
    short = rng.integers(max(1, round(args.short_len * 0.25)), round(args.short_len * 1.75) + 1, n)
    long_ = rng.integers(round(args.long_len * 0.75), round(args.long_len * 1.25) + 1, n)
    outputs = rng.integers(max(2, round(args.output_len * 0.5)), round(args.output_len * 1.5) + 1, n)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for t, lng, s, lg, o in zip(times, is_long, short, long_, outputs):
            f.write(json.dumps({"timestamp": round(1000 * t, 3), "input_length": int(lg if lng else s),
                                "output_length": int(o)}) + "\n")
    return n


def prompt_seed(seed: int, rate: float) -> int:
    """The seed of one rate's prompt tokens: every mode replays the same prompts at a rate,
    and each rate has its own. A mode serves its rates one after another on one platform,
    and traces of equal length have equal prompt lengths (the lengths are drawn after the
    arrival gaps, from the same stream): with one seed for all, a later rate's prompts
    were an earlier one's, whole prefix-cache hits (TTFT p50 87 ms on 1,000-token prompts)."""
    return seed * 1_000_003 + round(rate * 1000)


def sweep(mode: str, args, traces: dict[float, tuple[str, int]]) -> dict:
    num_prefill, num_decode, num_both, path_policy = MODES[mode]
    slo_path = os.path.join(args.result_dir, "slo.json")
    os.makedirs(args.result_dir, exist_ok=True)
    with open(slo_path, "w") as f:
        json.dump({"interactive": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_tpot_ms}}, f)
    cfg = PlatformConfig(model=args.model, num_prefill=num_prefill, num_decode=num_decode, num_both=num_both,
                         cpus_per_worker=1, path_policy=path_policy, short_prompt_tokens=args.short_prompt_tokens,
                         worker_args=tuple(args.worker_args.split()), prefill_args=tuple(args.prefill_args.split()),
                         router_args=("--slo-config", slo_path, *args.router_args.split()))
    slo = SLO(ttft_s=args.slo_ttft_ms / 1000, tpot_s=args.slo_tpot_ms / 1000)
    out_dir = os.path.join(args.result_dir, mode)
    rows = {}
    with local_platform(cfg, os.path.join(out_dir, "platform.log")) as p:
        p.warm_up()
        for rate, (path, n) in traces.items():
            label = f"rate{rate:g}"
            decisions_before = scrape_path_decisions(p.router_metrics())
            s = run_bench(BenchConfig(target=TargetConfig("grpc", p.router_address, timeout_s=900),
                                      dataset=DatasetConfig("mooncake", num_requests=n, path=path,
                                                            seed=prompt_seed(args.seed, rate)),
                                      arrivals=ArrivalConfig("trace"), slo=slo, label=f"{mode}-{label}",
                                      result_dir=out_dir, progress=False), quiet=True).summary
            rows[label] = {"rate": rate, "requests": n, "failed": s["failed"],
                           "goodput_share": round(s["goodput"]["share"], 3),
                           "goodput_rate": round(s["goodput"]["rate"], 3),
                           "ttft_ms": {k: round(1000 * s["ttft_s"][k]) for k in ("p50", "p99")},
                           "tpot_ms": {k: round(1000 * s["tpot_s"][k], 1) for k in ("p50", "p99")},
                           "itl_p99_ms": round(1000 * s["itl_s"]["p99"], 1), "paths": s["paths"],
                           "reasons": decisions_during(decisions_before, scrape_path_decisions(p.router_metrics()))}
            emit_row({mode: rows[label]}, sys.stderr)
            if s["goodput"]["share"] < 0.5:
                break
    return {"rates": rows, "max_rate_90pct": sustained_rate(rows.values())}


def rescore(args) -> dict:
    """Each mode's share under this SLO, from the per-request files of an earlier run in
    --result-dir: the same requests, another SLO (no request is re-sent)."""
    slo = SLO(ttft_s=args.slo_ttft_ms / 1000, tpot_s=args.slo_tpot_ms / 1000)
    out = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "result_dir": args.result_dir}
    for mode in MODES:
        rows = {}
        for path in sorted(glob.glob(os.path.join(args.result_dir, mode, f"{mode}-rate*.json"))):
            with open(path) as f:
                run = json.load(f)
            records = [RequestRecord(**r) for r in run["requests"]]
            rate = float(os.path.basename(path)[len(mode) + len("-rate"):-len(".json")])
            good = sum(meets_slo(r, slo) for r in records)
            rows[f"rate{rate:g}"] = {"rate": rate, "requests": len(records),
                                     "goodput_share": round(good / len(records), 3) if records else 0.0}
        if rows:
            out[mode] = {"rates": dict(sorted(rows.items(), key=lambda kv: kv[1]["rate"])),
                         "max_rate_90pct": sustained_rate(rows.values())}
    return out


def sustained_rate(rows) -> float:
    """The highest rate up to which every tested rate met the target share: a lucky trace
    at a higher rate after a failing one does not count (20-60 requests per rate are noisy)."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r["rate"]):
        if row["goodput_share"] < TARGET_SHARE:
            break
        best = row["rate"]
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rates", default="0.25,0.5,0.75,1.0,1.5", help="req/s, ascending")
    p.add_argument("--duration-s", type=float, default=60.0, help="each rate's trace length (about)")
    p.add_argument("--min-requests", type=int, default=20)
    p.add_argument("--short-len", type=int, default=128)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--long-share", type=float, default=0.25)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--short-prompt-tokens", type=int, default=256, help="the threshold policy's direct-path limit")
    p.add_argument("--worker-args", default="", help="extra flags for every worker")
    p.add_argument("--prefill-args", default="", help="extra flags for prefill workers")
    p.add_argument("--router-args", default="", help="extra flags for the router (e.g. '--placement least_loaded')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="/tmp/pdserve-bench/goodput")
    p.add_argument("--rescore", action="store_true",
                   help="send nothing: score the per-request files already in --result-dir against this SLO")
    args = p.parse_args()
    if args.rescore:
        emit_result(rescore(args))
        return 0
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        p.error(f"--modes: known modes are {list(MODES)}")
    rates = sorted(float(r) for r in args.rates.split(","))
    traces = {}
    for r in rates:
        path = os.path.join(args.result_dir, f"trace_rate{r:g}.jsonl")
        traces[r] = (path, write_trace(path, r, args))
    out = {"model": args.model, "cpus": len(os.sched_getaffinity(0)),
           **{k: v for k, v in vars(args).items() if k not in ("model", "modes", "rates")}, "rates": rates}
    for mode in modes:
        out[mode] = sweep(mode, args, traces)
    if "colocated" in out and out["colocated"]["max_rate_90pct"] > 0:
        max_rates = {mode: out[mode]["max_rate_90pct"] for mode in modes}
        out.update(ratios(max_rates, [("adaptive", "colocated"), ("threshold", "colocated"), ("both", "colocated"),
                                      ("both", "adaptive")], "max_rate_ratio_{a}_vs_{b}", digits=2))
    emit_result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
