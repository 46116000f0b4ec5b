"""bench/gpu_kernels.py's correctness-check path, at its tiny shapes in the interpreter."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_kernels.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_kernels_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bench_checks_pass_on_cpu(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--device", "cpu"])
    assert bench.main() == 0
    report = capsys.readouterr().out
    assert report.count(" ok\n") == 10 and "MISMATCH" not in report


def test_peak_bandwidth_table(bench):
    assert bench.peak_gbps("NVIDIA H200", None) == 4800
    assert bench.peak_gbps("NVIDIA H100 80GB HBM3", None) == 3350
    assert bench.peak_gbps("NVIDIA H100 PCIe", None) == 2000
    assert bench.peak_gbps("NVIDIA A100-SXM4-80GB", None) == 2039
    assert bench.peak_gbps("NVIDIA GeForce GTX 1080", None) is None
    assert bench.peak_gbps("NVIDIA H200", 1234.0) == 1234.0


@pytest.mark.filterwarnings("ignore:.*kernel not used because")
def test_timing_path_runs_with_a_stub_timer(bench, monkeypatch, capsys):
    """The timing code needs CUDA events; with a timer that just calls the function once it
    still runs every kernel and baseline call and prints the derived figures."""
    import torch
    from pdserve.kernels import paged_attention
    monkeypatch.setattr(bench, "time_ms", lambda fn: (fn(), 2.0)[1])
    shape, cpu = bench.MODELS[1], torch.device("cpu")
    fraction = bench.bench_decode(paged_attention, shape, 2, 600, torch.bfloat16, cpu, peak=10.0)
    bench.bench_prefill(paged_attention, shape, 2, 20, 47, torch.bfloat16, cpu)
    # 2 seqs x 600 tokens x 8 KV heads x 128 dims x K and V x 2 bytes, + q and out, in 2 ms.
    expected_gbps = (2 * 600 * 8 * 128 * 2 * 2 + 2 * 2 * 32 * 128 * 2) / 2.0 / 1e6
    assert fraction == pytest.approx(expected_gbps / 10.0)
    report = capsys.readouterr().out
    assert f"{expected_gbps:7.0f} GB/s" in report and "TFLOP/s" in report


def test_target_counts_only_on_h100_and_h200(bench):
    shape = bench.MODELS[1]
    assert bench.report_target(shape, "NVIDIA H100 80GB HBM3", 0.75)
    assert not bench.report_target(shape, "NVIDIA H200", 0.5)
    assert bench.report_target(shape, "NVIDIA A100-SXM4-80GB", 0.5)
