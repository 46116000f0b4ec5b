"""Issue 32, KV-aware placement under cache pressure: llm-d's "precise prefix-cache aware"
workload scaled to this machine. Many tenants, each with its own long system prompt; a
request is its tenant's prompt plus a short question. Together the prompts need several
times one worker's KV cache, so which worker a request lands on decides what is reused:

    tenants   T0 [prefix 0 .......][q]   T1 [prefix 1 .......][q]   ...   T7 [prefix 7 ...][q]
    worker A  cache holds ~ tenants/pressure of the prefixes
    worker B  the same

- `kv` (the default): the router's KV index says which worker holds the longest run of
  the prompt's blocks (its KV events), weighed against each worker's load;
- `affinity`: the first 16 tokens' hash names the worker (the placement before issue 13);
  each tenant sticks to one worker, the tenants split by hash, not by room;
- `least_loaded`: load alone; a tenant's requests scatter and every worker needs every
  prefix, which the cache cannot hold.

Each placement runs on a fresh `pdserve up` (cli/bench/local_platform.py), colocated by
default (2 decode workers, one core each, each prefills its own prompts: the setting of
llm-d's vLLM pods) with a KV cache of --kv-cache-tokens per worker, the same Poisson
trace of requests in tenant order shuffled by --seed. Prints one JSON line per placement
and the result: TTFT mean/p50/p90, output tok/s, the workers' prefix-cache hit rate,
requests per worker and the router's decisions by reason.

    .venv/bin/python -m bench.serve_cache_pressure [--placements kv,affinity,least_loaded --tenants 8
        --prefix-len 1024 --question-len 64 --output-len 32 --num-requests 60 --request-rate 0.3
        --kv-cache-tokens 4096]
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

import numpy as np

from bench.report import emit_result, emit_row
from bench.serve_chat_placement import _sum, scrape
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig, LengthDist, shared_prefix_requests
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.launcher import PlatformConfig
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.dtypes import DTYPE_SIZES
from pdserve.engine.model.loader import read_arch
from pdserve.engine.model.source import resolve_model

TOPOLOGIES = {"colocated": (0, 2), "disagg": (2, 1)}


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K and V of every layer for one token, as the engine's cache holds them."""
    arch = read_arch(resolve_model(model))
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * DTYPE_SIZES[dtype]


def tenant_trace(args) -> list:
    """num_requests requests over `tenants` system prompts, tenants in a shuffled order."""
    requests = shared_prefix_requests(DatasetConfig(
        "shared-prefix", num_requests=args.num_requests, input_len=LengthDist(args.question_len),
        output_len=LengthDist(args.output_len), prefix_len=args.prefix_len, num_prefixes=args.tenants,
        vocab_size=args.vocab_size, seed=args.seed))
    order = np.random.default_rng([args.seed, 7]).permutation(len(requests))
    return [requests[i] for i in order]


def run_placement(placement: str, args, requests) -> dict:
    from pdserve.cli.bench.main import BenchConfig, run_bench
    from pdserve.cli.bench.targets import TargetConfig
    num_prefill, num_decode = TOPOLOGIES[args.topology]
    cache_bytes = args.kv_cache_tokens * kv_bytes_per_token(args.model, args.dtype)
    cfg = PlatformConfig(model=args.model, num_prefill=num_prefill, num_decode=num_decode, cpus_per_worker=1,
                         http_port=None, path_policy="threshold", short_prompt_tokens=args.short_prompt_tokens,
                         router_args=("--placement", placement, *shlex.split(args.router_args)),
                         worker_args=("--kv-cache-memory-bytes", str(cache_bytes), *shlex.split(args.worker_args)))
    log = os.path.join(args.result_dir, f"{args.topology}-{placement}.log")
    with local_platform(cfg, log) as p:
        p.warm_up()
        specs = {s.name: s for s in p.platform.specs}
        prefilling = [n for n in specs if n.startswith("prefill-" if num_prefill else "decode-")]
        before = {n: scrape(specs[n].metrics_port) for n in prefilling}
        result = run_bench(BenchConfig(
            target=TargetConfig("grpc", p.router_address, timeout_s=1800),
            arrivals=ArrivalConfig("poisson", rate=args.request_rate, seed=args.seed),
            label=f"cache-pressure-{placement}", progress=False, plots=False), quiet=True, requests=requests)
        after = {n: scrape(specs[n].metrics_port) for n in prefilling}
        router = scrape(specs["router"].metrics_port)
    return summarize(result.summary, prefilling, before, after, router)


def summarize(summary: dict, workers, before, after, router) -> dict:
    def delta(name, n, **labels):
        return _sum(after[n], name, **labels) - _sum(before[n], name, **labels)
    queried = sum(delta("pdserve_prefix_cache_queried_tokens", n) for n in workers)
    hits = sum(delta("pdserve_prefix_cache_hit_tokens", n) for n in workers)
    ttft = summary["ttft_s"]
    pool = "prefill" if any(w.startswith("prefill") for w in workers) else "decode"
    reasons = {dict(ls)["reason"]: v for (n, ls), v in router.items()
               if n == "pdserve_router_placement_total" and v and dict(ls).get("pool") == pool}
    return {"completed": summary["completed"], "failed": summary["failed"], "errors": summary["errors"][:3],
            "duration_s": round(summary["duration_s"], 1),
            "ttft_ms": {k: round(ttft[k] * 1000) for k in ("mean", "p50", "p90") if ttft.get(k) is not None},
            "output_tok_s": round(summary["output_throughput"], 2),
            "prefix_hit_rate": round(hits / queried, 3) if queried else 0.0,
            "reuse_rate": round(summary["cached_tokens"] / summary["prompt_tokens"], 3) if summary["prompt_tokens"] else 0.0,
            "requests_per_worker": {n: int(delta("pdserve_worker_requests_total", n, outcome="ok")) for n in workers},
            "placement_reasons": reasons}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", help="the workers' KV dtype, for sizing the cache in tokens")
    p.add_argument("--topology", choices=TOPOLOGIES, default="colocated")
    p.add_argument("--placements", default="kv,affinity,least_loaded")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--request-rate", type=float, default=0.3, help="requests/s, Poisson")
    p.add_argument("--kv-cache-tokens", type=int, default=4096, help="each worker's KV cache, in tokens")
    p.add_argument("--short-prompt-tokens", type=int, default=64,
                   help="threshold paths: below the shortest prompt, so disagg sends every prompt to the prefill pool")
    p.add_argument("--router-args", default="", help="more router flags, one string")
    p.add_argument("--worker-args", default="", help="more worker flags, one string (e.g. '--kv-offloading-size 1')")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default="/tmp/pdserve-bench/cache_pressure")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.result_dir, exist_ok=True)
    requests = tenant_trace(args)
    prefixes_tokens = args.tenants * args.prefix_len
    out = {"model": args.model, "topology": args.topology, "tenants": args.tenants, "prefix_len": args.prefix_len,
           "question_len": args.question_len, "output_len": args.output_len, "num_requests": args.num_requests,
           "request_rate": args.request_rate, "kv_cache_tokens_per_worker": args.kv_cache_tokens,
           "prefixes_over_one_cache": round(prefixes_tokens / args.kv_cache_tokens, 2),
           "router_args": args.router_args, "worker_args": args.worker_args,
           "cpus": len(os.sched_getaffinity(0))}
    for placement in args.placements.split(","):
        out[placement] = run_placement(placement, args, requests)
        emit_row({placement: out[placement]}, sys.stderr)
    emit_result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
