"""Experiment 5, second half (issue 7), and issue 13: KV transfer time as a share of TTFT
on the disaggregated path, at a few prompt lengths (2k tokens the issue's point).

A `pdserve up` platform of real processes (1 prefill + 1 decode worker, each pinned to
its own core; kvstore and router floating), requests one at a time with distinct random
prompts of each length (nothing cached), timings from the services themselves:
TTFT = queue + prefill + KV write + other (router). Since issue 13 the prefill answers
with the first token before its KV is written: "KV write" is what remains of the write
on the first token's path (the lease, queueing the write), and the write itself runs in
the background (`kv_write_background_ms`, from the prefill's
pdserve_kv_transfer_seconds{direction="write"}). After the first token the decode worker
reads the KV (KV read: waiting for the write to end, if it has not, then the transfer)
and joins its batch. Prints one JSON line per length and a summary: KV write as a share
of TTFT, and KV write + read as a share of the time until the decode worker holds the
prompt's KV (TTFT + KV read).

    .venv/bin/python -m bench.serve_kv_ttft_share [--model smollm2 --prompt-lens 512,1024,2048
        --num-requests 3 --kv-transport ucx --seals aes-gcm,xxh3]

`--seals`: one platform after the other, in the same sitting: `aes-gcm` is the platform as
it serves (its token's keys seal and encrypt every block, services/worker/kv_seal.py);
`xxh3` the same with its workers sealing as a platform without a token does (the unkeyed
checksum: bench/unsealed/sitecustomize.py on their path), the cost before issue 49.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import urllib.request

from bench.report import emit_row
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.targets import TargetConfig
from pdserve.cli.launcher import PlatformConfig


def write_seconds(metrics_port: int) -> tuple[float, float]:
    """The prefill's background KV writes so far: (sum of seconds, count)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("sum", "count"):
            if line.startswith(f'pdserve_kv_transfer_seconds_{name}{{direction="write"}}'):
                values[name] = float(line.split()[-1])
    return values.get("sum", 0.0), values.get("count", 0.0)


def measure(address: str, prompt_len: int, args, result_dir: str, prefill_metrics_port: int) -> dict:
    cfg = BenchConfig(target=TargetConfig("grpc", address, timeout_s=900),
                      dataset=DatasetConfig("random", num_requests=args.num_requests, input_len=LengthDist(prompt_len),
                                            output_len=LengthDist(args.output_len), seed=prompt_len),
                      arrivals=ArrivalConfig(max_concurrency=1), label=f"prompt{prompt_len}",
                      result_dir=result_dir, plots=False, progress=False)
    write_before = write_seconds(prefill_metrics_port)
    s = run_bench(cfg, quiet=True).summary
    write_after = write_seconds(prefill_metrics_port)
    num_writes = write_after[1] - write_before[1]
    if s["failed"]:
        raise RuntimeError(f"prompt {prompt_len}: {s['errors']}")
    b = s["ttft_breakdown"]
    ms = {k: 1000 * b[k]["mean"] for k in ("router_ttft_s", "queue_s", "prefill_s", "kv_write_s", "other_s",
                                             "kv_read_s", "decode_join_s")}
    return {"prompt_len": prompt_len, "requests": s["completed"],
            "ttft_ms": round(1000 * s["ttft_s"]["mean"], 1),
            **{k.replace("_s", "_ms"): round(v, 1) for k, v in ms.items()},
            "kv_write_background_ms": round(1000 * (write_after[0] - write_before[0]) / max(num_writes, 1), 1),
            "kv_mb": round(prompt_len / 16 * args.block_mb, 1),
            "kv_write_share_of_ttft": round(ms["kv_write_s"] / ms["router_ttft_s"], 4),
            "kv_transfer_share_until_decode_holds_kv": round(
                (ms["kv_write_s"] + ms["kv_read_s"]) / (ms["router_ttft_s"] + ms["kv_read_s"]), 3)}


@contextlib.contextmanager
def unsealed_workers(unsealed: bool):
    """With `unsealed`, the processes started meanwhile import bench/unsealed/sitecustomize.py."""
    if not unsealed:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "unsealed"),
                                                *filter(None, [before])])
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt-lens", default="512,1024,2048")
    p.add_argument("--num-requests", type=int, default=3, help="per length, one at a time")
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--block-mb", type=float, default=30 * 2 * 16 * 3 * 64 * 4 / 1e6,
                   help="MB of KV per 16-token block (default: SmolLM2 float32), for the report")
    p.add_argument("--kv-transport", choices=("grpc", "ucx"), default="grpc")
    p.add_argument("--worker-args", default="", help="extra flags for every worker")
    p.add_argument("--result-dir", default="/tmp/pdserve-bench/kv_ttft_share")
    p.add_argument("--seals", default="aes-gcm", help="aes-gcm (as served), xxh3 (before issue 49), or both")
    args = p.parse_args()
    seals = args.seals.split(",")
    if set(seals) - {"aes-gcm", "xxh3"}:
        p.error(f"--seals: {args.seals!r}: give aes-gcm, xxh3 or both")
    lens = [int(n) for n in args.prompt_lens.split(",")]
    # the threshold path policy: every measured prompt crosses prefill -> kvstore -> decode
    cfg = PlatformConfig(model=args.model, num_prefill=1, num_decode=1, cpus_per_worker=1,
                         path_policy="threshold", short_prompt_tokens=min(lens) - 1, kv_transport=args.kv_transport,
                         worker_args=tuple(args.worker_args.split()))
    rows = []
    for seal in seals:
        with unsealed_workers(seal == "xxh3"), \
                local_platform(cfg, os.path.join(args.result_dir, f"platform-{seal}.log")) as platform:
            platform.warm_up()
            prefill_metrics_port = next(spec.metrics_port for spec in platform.platform.specs
                                        if spec.name == "prefill-0")
            for n in lens:
                rows.append({"seal": seal, **measure(platform.router_address, n, args, args.result_dir,
                                                     prefill_metrics_port)})
                emit_row(rows[-1], sys.stderr)
    print(json.dumps({"model": args.model, "kv_transport": args.kv_transport, "worker_args": args.worker_args,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
