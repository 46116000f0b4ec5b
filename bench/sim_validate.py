"""The simulator against the real platform (issue 18): measure a profile here
(`pdserve profile`), run `pdserve up` (1 prefill + 1 decode, and colocated: 1 worker)
on two Mooncake-format workloads with the bench client (`pdserve bench serve`, arrivals
from the trace), simulate the same traces with the fresh profile, and print measured vs
predicted TTFT and ITL p50/p90 with the error.

    .venv/bin/python bench/sim_validate.py [--out-dir /tmp/sim_validate] [--scale 1.0]

Each worker is pinned to one core (cpus_per_worker=1) and the profile is measured with
one torch thread, so both describe the same worker. `--scale` multiplies the request
counts (the defaults are small: the 2-core machine is shared).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli.bench.arrivals import ArrivalConfig  # noqa: E402
from cli.bench.datasets import DatasetConfig  # noqa: E402
from cli.bench.local_platform import local_platform  # noqa: E402
from cli.bench.main import BenchConfig, run_bench  # noqa: E402
from cli.bench.targets import TargetConfig  # noqa: E402
from cli.launcher import PlatformConfig  # noqa: E402
from sim.cluster import ClusterConfig, simulate  # noqa: E402
from sim.measure import measure  # noqa: E402
from sim.metrics import summarize  # noqa: E402
from sim.profile import load_profile, save_profile  # noqa: E402
from sim.trace import TraceRequest, write_trace  # noqa: E402

# name: (requests, input range, output range, mean gap between arrivals in s)
WORKLOADS = {"chat": (16, (32, 128), (16, 32), 2.0),
             "long-prompt": (12, (256, 512), (4, 8), 3.0)}
SETUPS = {"1P+1D": (1, 1), "colocated": (0, 1)}
METRICS = (("ttft_s", "p50"), ("ttft_s", "p90"), ("itl_s", "p50"), ("itl_s", "p90"))


def make_trace(name: str, scale: float, seed: int) -> list[TraceRequest]:
    n, (lo_in, hi_in), (lo_out, hi_out), gap = WORKLOADS[name]
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(max(2, round(n * scale))):
        out.append(TraceRequest(t, rng.randint(lo_in, hi_in), rng.randint(lo_out, hi_out),
                                tuple(range(seed * 100000 + i * 100, seed * 100000 + i * 100 + 2))))
        t += rng.expovariate(1 / gap)
    return out


def measured(setup: str, trace_path: str, n: int, log_dir: str) -> dict:
    num_prefill, num_decode = SETUPS[setup]
    cfg = PlatformConfig(num_prefill=num_prefill, num_decode=num_decode, cpus_per_worker=1, startup_timeout_s=900)
    with local_platform(cfg, log_path=os.path.join(log_dir, f"{setup}.log")) as platform:
        platform.warm_up()
        result = run_bench(BenchConfig(target=TargetConfig("grpc", platform.router_address, timeout_s=600),
                                       dataset=DatasetConfig("mooncake", num_requests=n, path=trace_path),
                                       arrivals=ArrivalConfig("trace"), progress=False), quiet=True)
    if result.summary["failed"]:  # e.g. a worker starved past the router's poll timeout: say so, compare the rest
        print(f"WARNING {setup}: {result.summary['failed']} requests failed: {result.summary.get('errors')}",
              flush=True)
    return result.summary


def _row(r: dict) -> str:
    return (f"| {r['workload']} | {r['setup']} | {r['metric']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} "
            f"| {r['error_pct']:+.0f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="/tmp/sim_validate")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="profile repeats per point")
    parser.add_argument("--profile", default=None, help="use this profile instead of measuring one now")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"load before: {os.getloadavg()}", flush=True)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        profile = measure("smollm2", 1, (16, 64, 128, 256, 512, 1024), (1, 2, 4, 8), (32, 256, 768),
                          (1, 4, 16, 64), args.repeats)
        save_profile(profile, os.path.join(args.out_dir, "profile.json"))
    print(f"profile: {profile.source}", flush=True)
    rows, loads = [], {}
    for seed, name in enumerate(WORKLOADS, 1):
        trace = make_trace(name, args.scale, seed)
        path = os.path.join(args.out_dir, f"{name}.jsonl")
        write_trace(path, trace)
        for setup, (num_prefill, num_decode) in SETUPS.items():
            real = measured(setup, path, len(trace), args.out_dir)
            loads[f"{name}/{setup}"] = os.getloadavg()[0]
            sim = summarize(simulate(trace, profile, ClusterConfig(num_prefill, num_decode)),
                            profile.request_overhead_s)
            for metric, pct in METRICS:
                m, p = real[metric][pct], sim[metric][pct]
                rows.append({"workload": name, "setup": setup, "metric": f"{metric[:-2].upper()} {pct}",
                             "measured_ms": m * 1000, "predicted_ms": p * 1000, "error_pct": (p - m) / m * 100,
                             "failed": real["failed"]})
                print(_row(rows[-1]), flush=True)  # as it goes: a later run may fail
            print(f"done {name}/{setup} (load {loads[f'{name}/{setup}']:.2f})", flush=True)
    print("\n| workload | setup | metric | measured (ms) | predicted (ms) | error |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(_row(r))
    within = sum(abs(r["error_pct"]) <= 20 for r in rows)
    print(f"\n{within}/{len(rows)} within 20%; 1-minute load average after each run: "
          + ", ".join(f"{k} {v:.2f}" for k, v in loads.items()))
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"profile_source": profile.source, "rows": rows, "load_avg": loads}, f, indent=1)


if __name__ == "__main__":
    main()
