"""The whole tool against an in-test cluster on the tiny model, over gRPC and over HTTP:
exact counts and token totals, the TTFT split from the services' timings (gRPC), and the
JSON and PNG files."""
from __future__ import annotations

import json

import pytest

from pdserve.cli.bench.arrivals import ArrivalConfig
from pdserve.cli.bench.datasets import DatasetConfig, LengthDist
from pdserve.cli.bench.main import BenchConfig, add_arguments, config_from_args, run_bench
from pdserve.cli.bench.metrics import SLO
from pdserve.cli.bench.targets import TargetConfig
from tests.services.router.fronts.http.support import base_url
from tests.services.test_disaggregated import assert_nothing_leaked

NUM = 6


def _dataset(name="random"):
    # prompts of 20-60 tokens: some take the direct path (< 32), most prefill -> kvstore -> decode
    return DatasetConfig(name, num_requests=NUM, input_len=LengthDist(40, "uniform", 0.5),
                         output_len=LengthDist(6, "uniform", 0.5), prefix_len=40 if name == "shared-prefix" else 0,
                         seed=1)


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_against_a_cluster(bench_cluster, tmp_path, backend, capsys):
    url = bench_cluster.router.address if backend == "grpc" else base_url(bench_cluster.router)
    cfg = BenchConfig(target=TargetConfig(backend=backend, url=url, timeout_s=120), dataset=_dataset(),
                      arrivals=ArrivalConfig("poisson", rate=50.0, max_concurrency=3, seed=2),
                      slo=SLO(ttft_s=1e6, tpot_s=1e6), label=f"run-{backend}", result_dir=str(tmp_path),
                      progress=True, vocab_size=None if backend == "grpc" else 4000)
    result = run_bench(cfg)
    s = result.summary
    asked = result.requests
    assert len(asked) == NUM and all(max(r.prompt) < (4000 if backend == "openai" else 1 << 20) for r in asked)
    assert (s["num_requests"], s["completed"], s["failed"]) == (NUM, NUM, 0), s["errors"]
    assert s["output_tokens"] == s["expected_output_tokens"] == sum(r.expected_output_tokens for r in result.records)
    for r in result.records:
        assert r.output_tokens == r.expected_output_tokens and r.finish_reason == "length"
        assert len(r.itl_s) == r.output_tokens - 1
    assert s["prompt_tokens"] == sum(r.prompt_len for r in asked)
    assert [r.prompt_tokens for r in result.records] == [r.prompt_len for r in asked]
    assert [r.output_tokens for r in result.records] == [r.output_len for r in asked]
    assert s["goodput"]["requests"] == NUM and s["goodput"]["share"] == 1.0
    assert s["ttft_s"]["n"] == NUM and s["itl_s"]["n"] == s["output_tokens"] - NUM
    if backend == "grpc":
        b = s["ttft_breakdown"]
        assert b["router_ttft_s"]["n"] == NUM and b["prefill_s"]["max"] > 0
        # the cluster's router sends prompts of at most 32 tokens direct (threshold policy)
        direct = sum(r.prompt_len <= 32 for r in asked)
        assert s["paths"] == {k: v for k, v in (("direct", direct), ("disaggregated", NUM - direct)) if v}
    else:
        assert s["ttft_breakdown"] is None and s["paths"] == {}  # the OpenAI API does not say
    doc = json.loads((tmp_path / f"run-{backend}.json").read_text())
    assert doc["summary"]["output_tokens"] == s["output_tokens"] and len(doc["requests"]) == NUM
    for key in ("cdf_png", "timeline_png"):
        with open(result.files[key], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "Serving benchmark" in printed and ("Requests by path" in printed) == (backend == "grpc")
    assert_nothing_leaked(bench_cluster)


def test_cli_shared_prefix_at_max_concurrency(bench_cluster, tmp_path, capsys):
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--url", bench_cluster.router.address, "--dataset", "shared-prefix", "--prefix-len", "48",
                         "--input-len", "8", "--output-len", "3", "--num-requests", "4", "--max-concurrency", "2",
                         "--slo-ttft-ms", "100000", "--slo-tpot-ms", "100000", "--result-dir", str(tmp_path),
                         "--label", "prefix", "--no-plots", "--no-progress"])
    result = run_bench(config_from_args(args))
    s = result.summary
    assert (s["completed"], s["prompt_tokens"], s["output_tokens"]) == (4, 4 * 56, 12)
    assert s["cached_tokens"] > 0  # the 48-token system prompt: 3 full blocks reused
    assert (tmp_path / "prefix.json").exists() and not (tmp_path / "prefix_cdf.png").exists()
    assert_nothing_leaked(bench_cluster)


@pytest.mark.parametrize("backend,url", [("grpc", "127.0.0.1:1"), ("openai", "http://127.0.0.1:1/v1")])
def test_unreachable_target_is_an_error_not_a_traceback(backend, url, capsys):
    from pdserve.cli.bench.main import main
    assert main(["--backend", backend, "--url", url, "--num-requests", "1", "--no-progress"]) == 2
    assert "cannot reach" in capsys.readouterr().err
