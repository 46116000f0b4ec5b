"""The serving experiments under bench/ run end to end on the tiny model with tiny
workloads: every mode's platform starts, every request completes, and the JSON they
print has the numbers docs/benchmarks.md quotes. (What they measure is recorded there,
not asserted here: speed is not a test.)"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_script(name: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", f"bench.{name.removesuffix('.py')}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_isolation_experiment(tiny_llama_dir, tmp_path):
    out = run_script("serve_isolation.py", "--model", tiny_llama_dir, "--modes", "disaggregated,colocated-no-chunking",
                     "--interactive-rate", "20", "--interactive-requests", "4", "--interactive-output-len", "6",
                     "--long-len", "120", "--long-output-len", "3", "--burst-size", "2", "--num-bursts", "1",
                     "--burst-delay-s", "0", "--short-prompt-tokens", "32",
                     "--worker-args", "--max-model-len 256", "--result-dir", str(tmp_path))
    for mode in ("disaggregated", "colocated-no-chunking"):
        assert out[mode]["alone"]["completed"] == out[mode]["with_bursts"]["completed"] == 4
        assert out[mode]["long"]["completed"] == 2
        assert out[mode]["itl_p99_ratio_bursts_vs_alone"] > 0
        assert (tmp_path / mode / "interactive-with-bursts.json").exists()
    assert math.isfinite(out["itl_p99_with_bursts_ratio_colocated-no-chunking_vs_disaggregated"])


def test_goodput_experiment(tiny_llama_dir, tmp_path):
    out = run_script("serve_goodput.py", "--model", tiny_llama_dir, "--rates", "5", "--duration-s", "1",
                     "--min-requests", "6", "--short-len", "16", "--long-len", "100", "--long-share", "0.5",
                     "--output-len", "4", "--short-prompt-tokens", "32", "--slo-ttft-ms", "60000",
                     "--slo-tpot-ms", "60000", "--modes", "threshold,colocated", "--result-dir", str(tmp_path))
    for mode in ("threshold", "colocated"):
        row = out[mode]["rates"]["rate5"]
        assert (row["requests"], row["failed"], row["goodput_share"]) == (6, 0, 1.0)  # an SLO no request can miss
        assert out[mode]["max_rate_90pct"] == 5.0
    assert out["max_rate_ratio_threshold_vs_colocated"] == 1.0
    # the threshold policy: prompts of 4-28 tokens direct, 75-125 through the prefill pool
    lengths = [json.loads(x)["input_length"] for x in (tmp_path / "trace_rate5.jsonl").read_text().splitlines()]
    direct = sum(n <= 32 for n in lengths)
    assert out["threshold"]["rates"]["rate5"]["paths"] == {k: v for k, v in
                                                          (("direct", direct), ("disaggregated", 6 - direct)) if v}
    assert out["colocated"]["rates"]["rate5"]["paths"] == {"direct": 6}
    # and by reason, from the router's counters: the run's own requests, not the warm-up's
    assert out["threshold"]["rates"]["rate5"]["reasons"] == {
        k: v for k, v in (("direct/short_prompt", direct), ("disaggregated/long_prompt", 6 - direct)) if v}
    assert out["colocated"]["rates"]["rate5"]["reasons"] == {"direct/colocated": 6}
    lines = (tmp_path / "trace_rate5.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all({"timestamp", "input_length", "output_length"} <= json.loads(x).keys()
                                   for x in lines)


def test_goodput_rates_replay_prompts_of_their_own(tmp_path):
    """Two rates with as many requests have the same prompt lengths: their tokens differ, so a
    platform serving both finds nothing of the first in its prefix cache; every mode gets
    the same tokens at one rate."""
    import argparse

    from bench.serve_goodput import prompt_seed, write_trace
    from pdserve.cli.bench.datasets import DatasetConfig, load_requests
    args = argparse.Namespace(seed=0, min_requests=3, duration_s=1, long_share=0.5, short_len=16, long_len=64,
                              output_len=4)

    def prompts(rate: float) -> list[tuple[int, ...]]:
        path = str(tmp_path / f"trace_{rate}.jsonl")
        n = write_trace(path, rate, args)
        cfg = DatasetConfig("mooncake", num_requests=n, path=path, seed=prompt_seed(0, rate), vocab_size=1000)
        return [r.prompt for r in load_requests(cfg)]
    assert [len(p) for p in prompts(0.5)] == [len(p) for p in prompts(0.6)]
    assert prompts(0.5) == prompts(0.5)
    assert all(a != b for a, b in zip(prompts(0.5), prompts(0.6)))


def test_kv_share_experiment(tiny_llama_dir, tmp_path):
    out = run_script("serve_kv_ttft_share.py", "--model", tiny_llama_dir, "--prompt-lens", "48,96",
                     "--num-requests", "2", "--result-dir", str(tmp_path))
    assert [r["prompt_len"] for r in out["rows"]] == [48, 96]
    for row in out["rows"]:
        assert row["requests"] == 2
        assert row["kv_write_ms"] > 0 and row["kv_read_ms"] > 0  # both went through the kvstore
        assert 0 < row["kv_write_share_of_ttft"] < 1 and 0 < row["kv_transfer_share_until_decode_holds_kv"] < 1
