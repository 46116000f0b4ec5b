"""The simulator's goodput against the platform's, on the traces of the comparison with
vLLM (bench/goodput_vs_vllm.py, issue 50): does the simulator that `pdserve plan` decides
layouts with predict what `pdserve up`'s default and colocated layouts serve here?

The traces are goodput_vs_vllm's (the same flags draw the same requests: Poisson arrivals,
a --long-shares share of long prompts), written in the Mooncake format the bench client and
the simulator read (timestamps in ms; each request's own hash ids, so nothing is shared).
Each platform runs as goodput_vs_vllm starts it, the router given the SLO as its default
class. It is measured with pdserve's own bench client (`pdserve bench serve`, arrivals from
the trace; goodput as vLLM's `request_goodput`: requests meeting both SLOs per second of the
run) and calibrated as bench/sim_validate.py does: probes of lone requests before each trace
and after the last (and the neighbour probe on a disaggregated layout) bring the profile to
the machine's speed. The simulator then runs the same traces with every worker on this one
host, and the bench prints measured and predicted goodput, SLO attainment and TTFT/TPOT p90.

    .venv/bin/python -m bench.sim_goodput [--profile P] --rates 0.3,0.5 --long-shares 0.3 --duration-s 150
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from bench.goodput_vs_vllm import PDSERVE_PLATFORMS, add_trace_arguments, write_trace as write_vllm_trace
from bench.machine import read_cpu_flags
from bench.report import emit_result
from bench.sim_validate import ProbeSamples, _calibration, probe, probe_neighbours
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.metrics import SLO
from pdserve.cli.bench.targets import TargetConfig
from pdserve.profiler.calibrate import calibrate
from pdserve.services.router.config import load_slo_classes
from pdserve.services.router.decide.config import RoutingConfig
from pdserve.sim.cluster import ClusterConfig, simulate
from pdserve.sim.metrics import summarize
from pdserve.sim.profile import load_profile, save_profile
from pdserve.sim.trace import TRACE_BLOCK_SIZE, TraceRequest, load_trace, write_trace

SLO_CLASS = "interactive"


def to_mooncake(vllm_trace: str, path: str) -> list[TraceRequest]:
    """goodput_vs_vllm's trace (timestamps in s, a hash id per 16 tokens) in the Mooncake
    format (ms, a hash id per 512 tokens), each request its own ids as before."""
    requests, next_id = [], 0
    with open(vllm_trace) as f:
        for line in f:
            rec = json.loads(line)
            blocks = -(-rec["input_length"] // TRACE_BLOCK_SIZE)
            requests.append(TraceRequest(float(rec["timestamp"]), rec["input_length"], rec["output_length"],
                                         tuple(range(next_id, next_id + blocks))))
            next_id += blocks
    t0 = requests[0].arrival_s
    write_trace(path, [replace(r, arrival_s=r.arrival_s - t0) for r in requests])
    return load_trace(path)  # what the bench client reads: arrivals in whole milliseconds


def predicted(trace: list[TraceRequest], profile, num_prefill: int, num_decode: int, routing: RoutingConfig,
              overhead_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """The simulator's summary of one trace, every worker on this one host (`pdserve up`)."""
    cfg = ClusterConfig(num_prefill, num_decode, routing, workers_per_host=num_prefill + num_decode)
    return summarize(simulate(trace, profile, cfg), overhead_s, slo_ttft_s, slo_tpot_s, num_prefill + num_decode)


def error_pct(predicted_value: float, measured_value: float) -> float | None:
    return None if not measured_value else round((predicted_value - measured_value) / measured_value * 100, 1)


def _p90_ms(stats: dict) -> float | None:
    v = stats.get("p90")
    return None if v is None else round(v * 1000, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=None, help="a profile JSON (`pdserve profile`); default: measured now")
    p.add_argument("--platforms", default=",".join(PDSERVE_PLATFORMS))
    add_trace_arguments(p)  # goodput_vs_vllm's: the same flags draw the same traces
    p.add_argument("--out-dir", default="/tmp/pdserve-bench/sim_goodput")
    args = p.parse_args(argv)
    unknown = [n for n in args.platforms.split(",") if n not in PDSERVE_PLATFORMS]
    if unknown:
        p.error(f"--platforms: unknown {unknown}; known: {list(PDSERVE_PLATFORMS)}")
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        p.error("--slo-ttft-ms, --slo-tpot-ms: must be > 0")
    return args


def _profile(args):
    if args.profile:
        return load_profile(args.profile)
    from pdserve.profiler.measure import measure
    # sim_validate's grid: prefill points every 64 tokens up to the chunk threshold
    profile = measure("smollm2", 1, (16, 64, 128, 192, 256, 320, 384, 448, 512), (1, 2, 4, 8),
                      (32, 256, 768), (1, 4, 16, 64), 5)
    save_profile(profile, os.path.join(args.out_dir, "profile.json"))
    return profile


def _traces(args) -> dict[str, tuple[str, list[TraceRequest]]]:
    traces = {}
    for share in (float(s) for s in args.long_shares.split(",")):
        for rate in (float(r) for r in args.rates.split(",")):
            key = f"long{share:g}_rate{rate:g}"
            vllm_path = os.path.join(args.out_dir, f"trace_{key}.vllm.jsonl")
            write_vllm_trace(vllm_path, rate, share, args)
            path = os.path.join(args.out_dir, f"trace_{key}.jsonl")
            traces[key] = (path, to_mooncake(vllm_path, path))
    return traces


def run_platform(args, name: str, traces: dict, profile, slo_path: str) -> dict:
    base = PDSERVE_PLATFORMS[name]
    cfg = replace(base, router_args=(*base.router_args, "--slo-config", slo_path), startup_timeout_s=900)
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    measured, samples = {}, ProbeSamples()
    with local_platform(cfg, os.path.join(args.out_dir, f"{name}.log")) as platform:
        platform.warm_up()
        router = platform.router_address
        for key, (path, trace) in traces.items():
            probe(router, samples)
            if cfg.num_prefill:
                probe_neighbours(router, samples)
            result = run_bench(BenchConfig(target=TargetConfig("grpc", router, timeout_s=600),
                                           dataset=DatasetConfig("mooncake", num_requests=len(trace), path=path),
                                           arrivals=ArrivalConfig("trace"), slo=slo, progress=False), quiet=True)
            measured[key] = result.summary
            print(f"{name} {key}: goodput {result.summary['goodput']['rate']:.3f} req/s, "
                  f"{result.summary['failed']} failed", flush=True)
        probe(router, samples)
        if cfg.num_prefill:
            probe_neighbours(router, samples)
    calibration = calibrate(profile, samples.result(), disaggregated=cfg.num_prefill > 0,
                            neighbours=samples.neighbours())
    print(f"{name} calibration: {_calibration(calibration)}", flush=True)
    calibrated = calibration.apply(profile)
    routing = RoutingConfig(slo_classes=load_slo_classes(slo_path), default_slo_class=SLO_CLASS)
    rows = {}
    for key, (_, trace) in traces.items():
        m = measured[key]
        s = predicted(trace, calibrated, cfg.num_prefill, cfg.num_decode, routing, calibration.request_overhead_s,
                      slo.ttft_s, slo.tpot_s)
        rows[key] = {"measured_goodput": round(m["goodput"]["rate"], 3), "predicted_goodput": round(s["goodput_rps"], 3),
                     "goodput_error_pct": error_pct(s["goodput_rps"], m["goodput"]["rate"]),
                     "measured_attainment": round(m["goodput"]["share"], 3),
                     "predicted_attainment": round(s["slo_attainment"], 3),
                     "measured_ttft_p90_ms": _p90_ms(m["ttft_s"]), "predicted_ttft_p90_ms": _p90_ms(s["ttft_s"]),
                     "measured_tpot_p90_ms": _p90_ms(m["tpot_s"]), "predicted_tpot_p90_ms": _p90_ms(s["tpot_s"]),
                     "failed": m["failed"], "paths": m["paths"]}
        print(f"{name} {key}: {rows[key]}", flush=True)
    return {"rows": rows, "calibration": _calibration(calibration)}


def main() -> int:
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"load before: {os.getloadavg()}", flush=True)
    profile = _profile(args)
    traces = _traces(args)
    slo_path = os.path.join(args.out_dir, "slo.json")
    with open(slo_path, "w") as f:
        json.dump({SLO_CLASS: {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_tpot_ms}}, f)
    result: dict = {name: run_platform(args, name, traces, profile, slo_path) for name in args.platforms.split(",")}
    errors = [abs(r["goodput_error_pct"]) for p in result.values() for r in p["rows"].values()
              if r["goodput_error_pct"] is not None]
    result.update(within_20pct=f"{sum(e <= 20 for e in errors)}/{len(errors)}", profile=profile.source,
                  slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, cpu=read_cpu_flags(),
                  cpus=len(os.sched_getaffinity(0)))
    emit_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
