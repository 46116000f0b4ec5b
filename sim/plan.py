"""`pdserve plan --trace T --profile P --slo-ttft-ms A --slo-tpot-ms B [--max-workers N]`:
DistServe's placement question by simulation. Every split of at most N workers into a
prefill and a decode pool (and colocated pools: 0 prefill workers) runs the trace; the
choices are ranked by goodput per worker: requests per second that meet both SLOs,
divided by the workers used (what a worker buys), ties to the fewer workers."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.sim.cluster import ClusterConfig, simulate
from pdserve.sim.main import add_common, load_inputs, router_config
from pdserve.sim.metrics import summarize


@dataclass(frozen=True)
class Choice:
    num_prefill: int
    num_decode: int
    summary: dict

    @property
    def label(self) -> str:
        return f"{self.num_prefill}P:{self.num_decode}D" if self.num_prefill else f"colocated x{self.num_decode}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--max-workers", type=int, default=8, help="the most workers in both pools together")
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--top", type=int, default=5, help="how many choices to print")


def search(trace, profile, router, slo_ttft_s: float, slo_tpot_s: float, max_workers: int,
           min_workers: int = 1) -> list[Choice]:
    """Every (prefill, decode) with min_workers <= prefill + decode <= max_workers, best first."""
    choices = []
    for total in range(max(min_workers, 1), max_workers + 1):
        for num_prefill in range(0, total):
            cfg = ClusterConfig(num_prefill, total - num_prefill, router)
            s = summarize(simulate(trace, profile, cfg), profile.request_overhead_s, slo_ttft_s, slo_tpot_s, total)
            choices.append(Choice(num_prefill, total - num_prefill, s))
    return sorted(choices, key=lambda c: (-c.summary["goodput_rps_per_worker"],
                                          c.num_prefill + c.num_decode, c.num_prefill))


def format_choices(choices: list[Choice], top: int) -> str:
    lines = ["rank  pools           workers  goodput/worker  goodput  attainment  TTFT p90  TPOT p90",
             "                                    (req/s)    (req/s)                (ms)      (ms)"]
    for i, c in enumerate(choices[:top], 1):
        s = c.summary
        ttft, tpot = _ms(s["ttft_s"]["p90"], 0), _ms(s["tpot_s"]["p90"], 1)
        lines.append(f"{i:>4}  {c.label:<15} {c.num_prefill + c.num_decode:>7}  {s['goodput_rps_per_worker']:>14.3f}"
                     f"  {s['goodput_rps']:>7.2f}  {s['slo_attainment'] * 100:>9.1f}%"
                     f"  {ttft:>8}  {tpot:>8}")
    return "\n".join(lines)


def _ms(seconds: float | None, digits: int) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}"


def run(args) -> int:
    if args.max_workers < 1 or args.min_workers < 1 or args.min_workers > args.max_workers:
        raise ValueError(f"--min-workers/--max-workers: need 1 <= min <= max, "
                         f"got {args.min_workers}/{args.max_workers}")
    if args.top < 1:
        raise ValueError(f"--top: must be >= 1, got {args.top}")
    trace, profile = load_inputs(args)
    choices = search(trace, profile, router_config(args), args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000,
                     args.max_workers, args.min_workers)
    print(f"profile: {profile.source}")
    print(f"trace: {args.trace}, {len(trace)} requests; SLOs: TTFT <= {args.slo_ttft_ms:g} ms, "
          f"TPOT <= {args.slo_tpot_ms:g} ms")
    print(format_choices(choices, args.top))
    return 0
