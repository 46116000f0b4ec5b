"""Experiment 3, prefix caching: TTFT of requests sharing a ~1k-token system prompt.

Three local clusters (in this process, on loopback: kvstore, prefill worker(s), one
decode worker, router; one set of weights), each measured with `pdserve bench serve`'s
code (cli/bench) over gRPC, one request at a time:

- off:     prefix caching off in the engines and every request's system prompt its own,
           so nothing can be reused anywhere: the full prompt is computed every time;
- local:   prefix caching on, one prefill worker, one shared system prompt (warmed up by
           one request first): the prefill worker's own prefix cache serves it;
- kvstore: two prefill workers with prefix caching off in their engines; the warm-up
           request goes through prefill worker A (its own router), the measured requests
           through worker B, which gets the system prompt's KV blocks that A wrote from
           the kvstore on every request: reuse across prefill workers.

Every run has the same prompt lengths (prefix + suffix) and output lengths. Prints one
JSON line: TTFT mean/p50 per condition, the prefill/KV split, cached tokens, and the
ratios off/local and off/kvstore.

    .venv/bin/python -m bench.serve_prefix_cache [--model smollm2 --prefix-len 1024
        --suffix-len 32 --output-len 8 --num-requests 8 --result-dir /tmp/pdserve-bench
        --kv-transport grpc|tcp|ucx|mooncake --conditions off,local,kvstore]

`--kv-transport` is how the workers move KV to and from the kvstore (the workers'
--kvstore-transport): it matters to the kvstore condition, where worker B reads the prefix.
`mooncake` puts the kvstore on the Mooncake backend (a real mooncake_master and store node
on loopback, cli/bench/mooncake_cluster.py): the block bytes go between the workers and
the store node, the kvstore holds the index. `ttft_ratio_kvstore_vs_local` is issue 32's
measure (target <= 1.25).

`--rounds R` measures the conditions interleaved instead: every condition's cluster up at
once, then R rounds of one request to each condition in a shuffled order (the same
suffix seed within a round), so a machine whose speed drifts (this VM's moves by 20-50 %
between sittings) slows every condition alike; it prints each condition's TTFT median and
mean and the median of the per-round ratios (`paired_ratio_kvstore_vs_local`).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.report import emit_result, ratios
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.mooncake_cluster import MooncakeCluster
from pdserve.cli.bench.targets import TargetConfig
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.decode.server import serve as serve_decode
from pdserve.services.kvstore.server import KVStoreConfig
from pdserve.services.kvstore.server import serve as serve_kvstore
from pdserve.services.prefill.server import serve as serve_prefill
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.server import serve as serve_router


@dataclass
class LocalCluster:
    kvstore: object
    prefills: list = field(default_factory=list)
    decode: object = None
    routers: list = field(default_factory=list)  # routers[i] sends prefills to prefill worker i only

    def stop(self) -> None:
        for part in [*self.routers, *self.prefills, self.decode, self.kvstore]:
            if part is not None:
                part.stop()


def start(model: str, loaded, num_prefill: int, prefix_caching: bool, kv_bytes: int,
          kv_transport: str = "grpc", mooncake: MooncakeCluster | None = None) -> LocalCluster:
    c = LocalCluster(serve_kvstore(KVStoreConfig(capacity_bytes=4 * kv_bytes, metrics_port=None,
                                                 tcp_port=0 if kv_transport == "tcp" else None,
                                                 ucx_port=0 if kv_transport == "ucx" else None,
                                                 backend="mooncake" if mooncake else "memory",
                                                 mooncake=mooncake.settings if mooncake else None)))
    try:
        cache = CacheConfig(kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=prefix_caching)
        cfg = WorkerConfig(engine=EngineConfig(model=model, cache=cache), kvstore_address=c.kvstore.address,
                           kvstore_transport=kv_transport)
        c.prefills = [serve_prefill(cfg, loaded) for _ in range(num_prefill)]
        c.decode = serve_decode(cfg, loaded)
        c.routers = [serve_router(RouterConfig(model=model, prefill_addresses=(p.address,),
                                               decode_addresses=(c.decode.address,),
                                               kvstore_address=c.kvstore.address, short_prompt_tokens=16,
                                               port=0, metrics_port=None)) for p in c.prefills]
    except Exception:
        c.stop()
        raise
    return c


def bench(router, args, label: str, num: int, seed: int, prefix_seed: int, num_prefixes: int = 1,
          quiet: bool = False) -> dict:
    dataset = DatasetConfig("shared-prefix", num_requests=num, input_len=LengthDist(args.suffix_len),
                            output_len=LengthDist(args.output_len), prefix_len=args.prefix_len,
                            num_prefixes=num_prefixes, seed=seed, prefix_seed=prefix_seed)
    cfg = BenchConfig(target=TargetConfig("grpc", router.address, timeout_s=600), dataset=dataset,
                      arrivals=ArrivalConfig("poisson", max_concurrency=1), label=label,
                      result_dir=None if quiet else args.result_dir, progress=not quiet)
    return run_bench(cfg, quiet=quiet).summary


def warm(model, loaded, args, name: str, mooncake: MooncakeCluster | None = None):
    """The condition's cluster, warmed up as `condition` does; (cluster, router measured)."""
    kv_bytes = args.kv_cache_mb << 20
    caching, prefills, warm_at, prefix_seed = {"off": (False, 1, 0, 99), "local": (True, 1, 0, 0),
                                              "kvstore": (False, 2, 0, 0)}[name]
    c = start(model, loaded, prefills, prefix_caching=caching, kv_bytes=kv_bytes, kv_transport=args.kv_transport,
              mooncake=mooncake)
    bench(c.routers[warm_at], args, "warmup", 1, seed=100, prefix_seed=prefix_seed, quiet=True)
    return c, c.routers[-1]


def interleaved(model, loaded, args, names: list[str], mooncake: MooncakeCluster | None) -> dict:
    """R rounds of one request per condition, in a shuffled order each round."""
    import random
    import statistics
    clusters = {}
    try:
        for name in names:
            clusters[name] = warm(model, loaded, args, name, mooncake)
        ttft: dict[str, list[float]] = {name: [] for name in names}
        order_rng = random.Random(0)
        for r in range(args.rounds):
            order = list(names)
            order_rng.shuffle(order)
            for name in order:
                # "off": a prompt of its own each round (nothing to reuse anywhere)
                s = bench(clusters[name][1], args, name, 1, seed=r, prefix_seed=1000 + r if name == "off" else 0,
                          quiet=True)
                ttft[name].append(1000 * s["ttft_s"]["mean"])
    finally:
        for c, _ in clusters.values():
            c.stop()
    out = {name: {"ttft_median_ms": round(statistics.median(v), 1), "ttft_mean_ms": round(statistics.mean(v), 1),
                  "ttft_ms": [round(x) for x in v]} for name, v in ttft.items()}
    if "kvstore" in ttft and "local" in ttft:
        out["paired_ratio_kvstore_vs_local"] = round(statistics.median(
            k / local for k, local in zip(ttft["kvstore"], ttft["local"])), 3)
    return out


def condition(model, loaded, args, name: str, mooncake: MooncakeCluster | None = None) -> dict:
    n, kv_bytes = args.num_requests, args.kv_cache_mb << 20
    if name == "off":
        c = start(model, loaded, 1, prefix_caching=False, kv_bytes=kv_bytes, kv_transport=args.kv_transport,
                  mooncake=mooncake)
        try:
            bench(c.routers[0], args, "warmup", 1, seed=100, prefix_seed=99, quiet=True)  # another prompt
            return bench(c.routers[0], args, "prefix-off", n, seed=0, prefix_seed=0, num_prefixes=n)
        finally:
            c.stop()
    if name == "local":
        c = start(model, loaded, 1, prefix_caching=True, kv_bytes=kv_bytes, kv_transport=args.kv_transport,
                  mooncake=mooncake)
        try:
            bench(c.routers[0], args, "warmup", 1, seed=100, prefix_seed=0, quiet=True)
            return bench(c.routers[0], args, "prefix-local", n, seed=0, prefix_seed=0)
        finally:
            c.stop()
    c = start(model, loaded, 2, prefix_caching=False, kv_bytes=kv_bytes, kv_transport=args.kv_transport,
              mooncake=mooncake)
    try:
        bench(c.routers[0], args, "warmup", 1, seed=100, prefix_seed=0, quiet=True)  # through worker A
        return bench(c.routers[1], args, "prefix-kvstore", n, seed=0, prefix_seed=0)  # through worker B
    finally:
        c.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="each worker's KV cache (the kvstore: 4x)")
    p.add_argument("--result-dir", default="/tmp/pdserve-bench/prefix_cache")
    p.add_argument("--conditions", default="off,local,kvstore")
    p.add_argument("--rounds", type=int, default=0,
                   help="interleave the conditions: this many rounds of one request each (0: one condition after another)")
    p.add_argument("--kv-transport", choices=("grpc", "tcp", "ucx", "mooncake"), default="grpc",
                   help="the workers' --kvstore-transport (default: grpc; mooncake: the Mooncake backend)")
    args = p.parse_args()
    model = args.model
    loaded = load_model(resolve_model(args.model), torch.float32, "cpu", progress=False)
    out = {"model": args.model, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
           "output_len": args.output_len, "num_requests": args.num_requests, "torch_threads": torch.get_num_threads(),
           "kv_transport": args.kv_transport}
    with contextlib.ExitStack() as stack:
        mooncake = None
        if args.kv_transport == "mooncake":  # a segment for the kvstore's 4x of a worker's cache
            mooncake = MooncakeCluster(Path(tempfile.mkdtemp(prefix="bench-mooncake-")),
                                       segment_bytes=4 * (args.kv_cache_mb << 20)).start_all()
            stack.callback(mooncake.stop)
            mooncake.touch_segments()  # as a node that has served a while: its pages mapped
        if args.rounds:
            out.update(interleaved(model, loaded, args, args.conditions.split(","), mooncake))
            emit_result(out)
            return 0
        for name in args.conditions.split(","):
            out[name] = summarize_condition(condition(model, loaded, args, name, mooncake))
    ttft = {name: out[name]["ttft_mean_ms"] for name in args.conditions.split(",")}
    out.update(ratios(ttft, [("off", "local"), ("off", "kvstore"), ("kvstore", "local")], "ttft_ratio_{a}_vs_{b}"))
    emit_result(out)
    return 0


def summarize_condition(s: dict) -> dict:
    b = s["ttft_breakdown"] or {}
    return {"completed": s["completed"], "ttft_mean_ms": 1000 * s["ttft_s"]["mean"],
            "ttft_p50_ms": 1000 * s["ttft_s"]["p50"], "ttft_p90_ms": 1000 * s["ttft_s"]["p90"],
            "prefill_mean_ms": 1000 * b["prefill_s"]["mean"],
            "kv_write_mean_ms": 1000 * b["kv_write_s"]["mean"],
            "other_mean_ms": 1000 * b["other_s"]["mean"], "kv_read_mean_ms": 1000 * b["kv_read_s"]["mean"],
            "cached_tokens_per_request": s["cached_tokens"] / max(s["completed"], 1)}


if __name__ == "__main__":
    sys.exit(main())
