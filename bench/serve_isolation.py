"""Experiments 1 and 4, isolation and chunked prefill: the ITL of steady interactive
streams while bursts of long prompts arrive, disaggregated against colocated.

Each mode is a `pdserve up` platform of real processes on loopback (cli/bench/
local_platform.py), each worker pinned to its own core (`--cpus-per-worker`, one torch
thread per core), the router and kvstore floating:

- disaggregated:          1 prefill + 1 decode worker, the router's default (adaptive)
                          paths: the interactive prompts through the prefill worker while it
                          is idle, on the decode worker in small chunks while it is busy;
                          the long ones through prefill -> kvstore -> decode
                          (`--router-args "--path-policy threshold"`: the fixed rule);
- colocated:              2 decode workers and no prefill pool: each worker prefills its
                          own prompts, long ones in chunks of --long-prefill-token-threshold
                          mixed into the decode steps (chunked prefill, the default);
- colocated-no-chunking:  the same with `--no-chunked-prefill`: a long prompt is one step;
- colocated-small-chunks: chunks of 128 tokens (a step budget of 256) instead of 512.

Each mode runs two phases on the same platform after a warm-up: interactive streams
alone (Poisson arrivals), then the same streams (other prompts of the same lengths, the
same arrival times) with bursts of long prompts sent alongside. Prints one JSON line:
per mode and phase the interactive ITL/TPOT/TTFT and the long prompts' TTFT, each mode's
ITL p99 ratio burst / no burst (the issue expects <= 1.25 disaggregated), and the ITL p99
ratios under bursts of each colocated mode to disaggregated, and of the other colocated
modes to the default one. The ITL maximum, TPOT p99 and the streams' TTFT p99 are
printed too: a stall that hits few tokens (a whole prefill in one step) hides below the
ITL p99 but not there.

    .venv/bin/python -m bench.serve_isolation [--model smollm2 --modes disaggregated,colocated,
        colocated-no-chunking --interactive-rate 0.5 --interactive-requests 30 --long-len 2048
        --result-dir /tmp/pdserve-bench/isolation]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from bench.report import emit_result, emit_row, ratios
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.report import table
from pdserve.cli.bench.targets import TargetConfig
from pdserve.cli.launcher import PlatformConfig

MODES = {
    "disaggregated": {"num_prefill": 1, "num_decode": 1, "worker_args": ()},
    "colocated": {"num_prefill": 0, "num_decode": 2, "worker_args": ()},
    "colocated-no-chunking": {"num_prefill": 0, "num_decode": 2, "worker_args": ("--no-chunked-prefill",)},
    # chunks sized for a CPU core (128 tokens ~ 0.4 s of SmolLM2 here) instead of the default 512
    "colocated-small-chunks": {"num_prefill": 0, "num_decode": 2,
                               "worker_args": ("--long-prefill-token-threshold", "128",
                                               "--max-num-batched-tokens", "256")},
}


def _run(address: str, dataset: DatasetConfig, arrivals: ArrivalConfig, label: str, result_dir: str | None) -> dict:
    cfg = BenchConfig(target=TargetConfig("grpc", address, timeout_s=900), dataset=dataset, arrivals=arrivals,
                      label=label, result_dir=result_dir, progress=False)
    result = run_bench(cfg, quiet=True)
    summary = result.summary
    if result_dir:
        print(table(summary, label), file=sys.stderr, flush=True)
    if summary["failed"]:
        first = next(r.error for r in result.records if r.error)
        raise RuntimeError(f"{label}: {summary['failed']} requests failed; the first: {first}")
    return summary


def interactive(args, seed: int) -> tuple[DatasetConfig, ArrivalConfig]:
    return (DatasetConfig("random", num_requests=args.interactive_requests, input_len=LengthDist(args.interactive_len),
                          output_len=LengthDist(args.interactive_output_len), seed=seed),
            ArrivalConfig("poisson", rate=args.interactive_rate, seed=0))  # the same arrival times in each phase


def bursts(args) -> tuple[DatasetConfig, ArrivalConfig]:
    # evenly spaced inside each burst, `burst_size` prompts per burst, a burst every `burst_period_s`
    return (DatasetConfig("random", num_requests=args.burst_size * args.num_bursts, input_len=LengthDist(args.long_len),
                          output_len=LengthDist(args.long_output_len), seed=7),
            ArrivalConfig("burst", rate=0.0, burst_rate=float(args.burst_size), on_s=1.0,
                          off_s=args.burst_period_s - 1.0, burst_poisson=False))


def measure_mode(mode: str, args) -> dict:
    spec = MODES[mode]
    cfg = PlatformConfig(model=args.model, num_prefill=spec["num_prefill"], num_decode=spec["num_decode"],
                         cpus_per_worker=1, short_prompt_tokens=args.short_prompt_tokens,
                         worker_args=(*spec["worker_args"], *args.worker_args.split()),
                         router_args=tuple(args.router_args.split()))
    out_dir = os.path.join(args.result_dir, mode)
    with local_platform(cfg, os.path.join(out_dir, "platform.log")) as p:
        print(f"{mode}: up, cpus {p.cpus()}", file=sys.stderr, flush=True)
        p.warm_up()
        quiet = _run(p.router_address, *interactive(args, seed=1), "interactive-alone", out_dir)
        results: dict = {}

        def long_prompts() -> None:
            time.sleep(args.burst_delay_s)
            results["long"] = _run(p.router_address, *bursts(args), "long-bursts", out_dir)

        sender = threading.Thread(target=long_prompts, daemon=True)
        sender.start()
        loud = _run(p.router_address, *interactive(args, seed=2), "interactive-with-bursts", out_dir)
        sender.join()
    return {"alone": _interactive_view(quiet), "with_bursts": _interactive_view(loud),
            "long": _long_view(results["long"]),
            "itl_p99_ratio_bursts_vs_alone": loud["itl_s"]["p99"] / quiet["itl_s"]["p99"]}


def _ms(stats: dict, *keys: str) -> dict:
    return {k: round(1000 * stats[k], 1) for k in keys}


def _interactive_view(s: dict) -> dict:
    return {"itl_ms": _ms(s["itl_s"], "mean", "p50", "p90", "p99", "max"), "tpot_ms": _ms(s["tpot_s"], "mean", "p99"),
            "ttft_ms": _ms(s["ttft_s"], "mean", "p99"), "completed": s["completed"]}


def _long_view(s: dict) -> dict:
    return {"ttft_ms": _ms(s["ttft_s"], "mean", "max"), "e2e_ms": _ms(s["e2e_s"], "mean"), "completed": s["completed"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--interactive-rate", type=float, default=0.5, help="req/s of interactive streams")
    p.add_argument("--interactive-requests", type=int, default=30)
    p.add_argument("--interactive-len", type=int, default=64)
    p.add_argument("--interactive-output-len", type=int, default=64)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--burst-size", type=int, default=2, help="long prompts per burst")
    p.add_argument("--num-bursts", type=int, default=2)
    p.add_argument("--burst-period-s", type=float, default=25.0)
    p.add_argument("--burst-delay-s", type=float, default=5.0, help="the first burst, after the streams start")
    p.add_argument("--short-prompt-tokens", type=int, default=256, help="the router's direct-path threshold")
    p.add_argument("--worker-args", default="", help="extra flags for every worker")
    p.add_argument("--router-args", default="", help="extra flags for the router (e.g. '--path-policy threshold')")
    p.add_argument("--result-dir", default="/tmp/pdserve-bench/isolation")
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; known: {list(MODES)}")
    out = {"model": args.model, "cpus": len(os.sched_getaffinity(0)), **{k: v for k, v in vars(args).items()
                                                                         if k not in ("model", "modes")}}
    for mode in modes:
        out[mode] = measure_mode(mode, args)
        emit_row({mode: out[mode]}, sys.stderr)
    p99 = {m: out[m]["with_bursts"]["itl_ms"]["p99"] for m in modes}
    pairs = [(m, "disaggregated") for m in modes if m != "disaggregated"]
    pairs += [(m, "colocated") for m in ("colocated-no-chunking", "colocated-small-chunks")]
    out.update(ratios(p99, pairs, "itl_p99_with_bursts_ratio_{a}_vs_{b}"))
    emit_result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
