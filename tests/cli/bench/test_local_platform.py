"""The benchmark experiments' platform: real `pdserve` processes on free ports, workers
pinned to their own cores, usable as soon as it is yielded (the router already sees
every worker), and every process gone afterwards."""
from __future__ import annotations

import os

from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.local_platform import local_platform
from pdserve.cli.bench.main import BenchConfig, run_bench
from pdserve.cli.bench.targets import TargetConfig
from pdserve.cli.launcher import PlatformConfig


def test_colocated_platform_serves_long_prompts_on_pinned_workers(tiny_llama_dir, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    cfg = PlatformConfig(model=tiny_llama_dir, num_prefill=0, num_decode=2, cpus_per_worker=1,
                         path_policy="threshold", short_prompt_tokens=8, worker_args=("--no-chunked-prefill", "--max-model-len", "256"))
    with local_platform(cfg, str(tmp_path / "platform.log"), cpus=cpus) as p:
        procs = dict(p.platform.procs)
        pinned = {name: os.sched_getaffinity(proc.pid) for name, proc in procs.items() if name.startswith("decode")}
        # every thread of a worker, those it started since too (torch's, gRPC's)
        threads = {name: {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{proc.pid}/task")}
                   for name, proc in procs.items() if name.startswith("decode")}
        # no warm-up and no wait: the first request must already find both workers
        s = run_bench(BenchConfig(target=TargetConfig("grpc", p.router_address, timeout_s=120),
                                  dataset=DatasetConfig("random", num_requests=6, input_len=LengthDist(100),
                                                        output_len=LengthDist(5), seed=3),
                                  progress=False), quiet=True).summary
        assert (s["completed"], s["failed"]) == (6, 0), s["errors"]
        assert s["output_tokens"] == 30
        # colocated: the router has no prefill pool, so 100-token prompts (> 8) went direct
        assert s["ttft_breakdown"]["prefill_s"]["max"] == 0.0
    assert pinned == {"decode-0": {cpus[0]}, "decode-1": {cpus[-1]}}
    assert threads == {"decode-0": {frozenset({cpus[0]})}, "decode-1": {frozenset({cpus[-1]})}}
    assert all(proc.poll() is not None for proc in procs.values())
    assert "decode worker serving" in (tmp_path / "platform.log").read_text()
