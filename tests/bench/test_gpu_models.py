"""bench/gpu_models.py on a CPU machine: it refuses clearly without CUDA, and its dry run (the
same code, torch backend, float32, both sizes scaled to CPU, 3-4 prompts) is token-exact with
transformers. The GPU run itself needs a lent CUDA machine
(docs/benchmarks.md); the large size's config at its GPU shape is checked here without a run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_models
from bench.tiny_checkpoints import ARCHITECTURES, build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # no result file unless --out asks
    return subprocess.run([sys.executable, "-m", "bench.gpu_models", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run")
def test_without_cuda_it_exits_2_saying_cuda_is_missing():
    result = run()
    assert result.returncode == 2, result
    assert "gpu_models: no CUDA device" in result.stderr and f"torch {torch.__version__}" in result.stderr
    assert "--dry-run" in result.stderr and result.stdout == ""


def test_a_missing_package_is_named(monkeypatch, capsys):
    monkeypatch.setitem(gpu_models.REQUIRED, "no_such_module_for_gpu_models", "no-such-dist")
    assert gpu_models.main(["--dry-run"]) == 2
    assert "gpu_models: missing Python packages: no-such-dist" in capsys.readouterr().err


def test_an_unknown_architecture_is_refused():
    result = run("--archs", "mistral,no_such_arch")
    assert result.returncode == 2
    assert "unknown no_such_arch" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path")
def test_dry_run_is_token_exact_on_the_architectures_asked(tmp_path):
    # two of them: the script's path is the same for each, and tests/engine proves every
    # architecture token-exact; mistral has the sliding window, gemma2 the softcapped eager reference
    archs = ("mistral", "gemma2")
    result = run("--dry-run", "--archs", ",".join(archs), "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    table = [line.split("|")[1:5] for line in lines if "| float32 |" in line]
    assert [[c.strip() for c in cells] for cells in table] == \
        [[arch, size, "float32", "PASS"] for size in ("tiny", "large") for arch in archs]
    summary = json.loads(lines[-1])
    assert summary["float32_passed"] == summary["float32_runs"] == 2 * len(archs)
    assert summary["failed"] == summary["skipped"] == [] and summary["mode"].startswith("dry run on CPU")
    report = json.loads((tmp_path / "gpu_models.json").read_text())
    for row in report["rows"]:
        assert row["exact"] == row["prompts"] == {"tiny": 4, "large": 3}[row["size"]], row
        assert row["max_logprob_diff"] < 1e-4 and row["kv"]["num_blocks"] > 0, row
    windowed = [r for r in report["rows"] if r["size"] == "large" and r["arch"] == "mistral"]
    assert windowed[0]["prompt_lengths"] == [40, 150, 133]  # past the scaled window of 48


def test_runs_past_the_time_limit_are_skipped_and_fail_the_exit(tmp_path):
    result = run("--dry-run", "--archs", "mistral", "--time-limit-s", "0", "--out", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "| mistral | tiny | float32 | SKIP | out of time (--time-limit-s 0) |" in result.stdout
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["skipped"] == ["mistral/tiny/float32", "mistral/large/float32"]
    assert json.loads((tmp_path / "gpu_models.json").read_text())["skipped"] == summary["skipped"]


def test_compare_finds_first_divergences_and_the_gap_there():
    ref = torch.log_softmax(torch.tensor([[2.0, 1.9, 0.0], [0.0, 3.0, 0.0], [3.0, 0.0, 0.0]]), -1)
    got_lp = [float(ref[0, 0]), float(ref[1, 1]) + 2e-3, float(ref[2, 0])]
    c = gpu_models.compare([[0, 1, 0], [0, 1, 0]], [ref, ref], [[0, 1, 0], [1, 2, 2]], [got_lp, got_lp])
    assert c["exact"] == 1 and c["first_divergences"] == [0]
    assert c["max_divergence_gap"] == pytest.approx(0.1, abs=1e-5)  # logits 2.0 vs 1.9: a near tie
    assert c["max_logprob_diff"] == pytest.approx(2e-3, abs=1e-6)   # only the agreed tokens count


def test_the_large_config_scales_each_architecture_keeping_its_features(tmp_path):
    tokenizer = gpu_models.word_level_tokenizer(gpu_models.DRY_VOCAB_SIZE)
    layer_types = {}
    for name in ARCHITECTURES:
        config = gpu_models.scaled_config(build_tiny_checkpoint(name, tmp_path / name, tokenizer), gpu_models.LARGE)
        assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (1024, 8, 128)
        assert getattr(config, "sliding_window", None) in (None, 512)
        layer_types[name] = getattr(config, "layer_types", None)
    s, f = "sliding_attention", "full_attention"
    assert layer_types["gemma2"] == [s, f] * 4
    assert layer_types["gemma3"] == [s] * 5 + [f] + [s] * 2
    assert layer_types["qwen3"] == [f] + [s] * 7
    qwen3 = gpu_models.scaled_config(str(tmp_path / "qwen3"), gpu_models.LARGE)
    assert qwen3.rope_parameters["original_max_position_embeddings"] == 512  # 2048 / factor 4
    assert gpu_models.llm_kwargs(gpu_models.LARGE) == {"gpu_memory_utilization": 0.5}
    assert gpu_models.llm_kwargs(gpu_models.TINY) == {"kv_cache_memory_bytes": 256 << 20}
