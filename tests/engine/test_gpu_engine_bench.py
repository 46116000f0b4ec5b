"""bench/gpu_engine.py without a GPU: it refuses clearly, and its whole measuring path runs on
CPU with the CUDA calls stubbed and EagerGraph standing in for the capture."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.worker.cuda_graphs import EagerGraph

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_engine.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_engine_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_exits_with_a_clear_message(bench, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [str(BENCH)])
    with pytest.raises(SystemExit, match="CUDA is not available on this machine"):
        bench.main()


def test_agreement_reports_the_earliest_divergence(bench):
    assert bench.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == \
        {"requests_equal": 2, "requests": 2, "earliest_divergence": None}
    assert bench.agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]])["earliest_divergence"] == 1


def test_measuring_path_runs_on_cpu_with_stubs(bench, monkeypatch, tiny_llama_dir, capsys):
    for name, stub in [("is_available", lambda: True), ("synchronize", lambda *a: None),
                       ("empty_cache", lambda *a: None), ("get_device_name", lambda *a: "stub")]:
        monkeypatch.setattr(torch.cuda, name, stub)
    load_model, llm_class = bench.load_model, bench.LLM
    monkeypatch.setattr(bench, "load_model", lambda source, dtype, device, **kw: load_model(source, dtype, "cpu", **kw))

    def cpu_llm(*args, device, attention_backend, cuda_graph_batch_sizes, **kwargs):
        llm = llm_class(*args, **kwargs)
        if cuda_graph_batch_sizes:
            engine = llm.engine
            engine.runner.capture_decode_graphs(cuda_graph_batch_sizes, engine.max_model_len,
                                                engine.scheduler.config.max_num_seqs, graph_type=EagerGraph)
        return llm
    monkeypatch.setattr(bench, "LLM", cpu_llm)
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--model", tiny_llama_dir, "--dtypes", "float32",
                                      "--num-prompts", "2", "--batch-sizes", "1,3", "--graph-sizes", "1,2,4",
                                      "--steps", "3", "--prompt-len", "20", "--kv-cache-memory-bytes", str(16 << 20)])
    assert bench.main() == 0
    eager, graphs, summary = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert eager["cuda_graphs"] == [] and eager["offline_steps"] == {"graph": 0, "eager": 0}
    assert graphs["cuda_graphs"] == [1, 2, 4] and graphs["offline_steps"]["graph"] > 0
    assert graphs["decode_steps"]["graph"] >= 2 * 3  # every timed step of batches 1 and 3
    assert [row["batch"] for row in graphs["decode"]] == [1, 3]
    assert summary["graph_tokens_vs_eager"] == {"requests_equal": 2, "requests": 2, "earliest_divergence": None}
