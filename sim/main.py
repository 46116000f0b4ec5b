"""`pdserve sim --trace T --profile P --prefill N --decode M [--colocated]`: simulate the
cluster on a Mooncake trace and print TTFT / ITL / TPOT percentiles, SLO attainment and
goodput. The router's settings are its own defaults (RoutingConfig), as `pdserve up` runs it."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

from pdserve.services.router.decide.config import PLACEMENTS, PathConfig, RoutingConfig
from pdserve.services.router.decide.paths import PATH_POLICIES
from pdserve.sim.cluster import ClusterConfig, simulate
from pdserve.sim.metrics import format_summary, summarize
from pdserve.sim.profile import load_profile
from pdserve.sim.trace import load_trace


def add_common(p: argparse.ArgumentParser) -> None:
    """Flags `sim` and `plan` share."""
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL (timestamp ms, input_length, "
                                                  "output_length, hash_ids)")
    p.add_argument("--profile", required=True, help="a profile JSON (`pdserve profile`, or sim/profiles/*.json)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--path-policy", choices=PATH_POLICIES, default=PathConfig.policy)
    p.add_argument("--placement", choices=PLACEMENTS, default=RoutingConfig.placement)
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's arrival times")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0 or --colocated: none)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--colocated", action="store_true", help="no prefill pool: every decode worker prefills")
    p.add_argument("--workers-per-host", type=int, default=1,
                   help="workers sharing a host, prefill first (`pdserve up` on one machine: all); the "
                        "profile's neighbour factors slow their steps while more than one steps")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def router_config(args) -> RoutingConfig:
    return RoutingConfig(paths=replace(PathConfig(), policy=args.path_policy), placement=args.placement)


def load_inputs(args):
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise ValueError("--slo-ttft-ms, --slo-tpot-ms: must be > 0")
    if args.time_scale <= 0:
        raise ValueError(f"--time-scale: must be > 0, got {args.time_scale}")
    trace = load_trace(args.trace)
    if args.time_scale != 1.0:
        trace = [replace(r, arrival_s=r.arrival_s * args.time_scale) for r in trace]
    return trace, load_profile(args.profile)


def run(args) -> int:
    trace, profile = load_inputs(args)
    num_prefill = 0 if args.colocated else args.prefill
    cfg = ClusterConfig(num_prefill, args.decode, router_config(args), workers_per_host=args.workers_per_host)
    requests = simulate(trace, profile, cfg)
    summary = summarize(requests, profile.request_overhead_s, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                        num_prefill + args.decode)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        label = f"{num_prefill}P+{args.decode}D" if num_prefill else f"colocated {args.decode}"
        print(f"profile: {profile.source}")
        print(format_summary(summary, label))
    return 0
