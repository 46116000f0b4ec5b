"""bench/gpu_check/ on a CPU machine: it refuses clearly without CUDA, lists its six checks,
and its dry run passes the kernel check in Triton's interpreter and skips, saying why, every
check that needs a GPU. The GPU run itself needs a lent CUDA machine (docs/benchmarks.md)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["triton_kernels", "engine_vs_transformers_bf16", "cuda_graphs_vs_eager", "pd_up_one_gpu",
          "decode_step_time", "offline_tokens_per_s"]
GPU_ONLY = CHECKS[1:]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


@pytest.fixture
def gpu_check():
    """The package as `python -m bench.gpu_check` runs it (a test patching it uses monkeypatch)."""
    return importlib.import_module("bench.gpu_check")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_it_exits_2_saying_cuda_is_missing():
    result = run()
    assert result.returncode == 2, result
    assert "gpu_check: no CUDA device" in result.stderr
    assert f"torch {torch.__version__}" in result.stderr
    assert "runs only on a CUDA machine" in result.stderr
    assert "CHECK" not in result.stdout


def test_list_names_all_six_checks_with_their_budgets():
    result = run("--list")
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[:6]] == CHECKS
    assert "cpu dry run" in lines[0] and all("GPU only" in line for line in lines[1:6])
    assert lines[6].startswith("whole run: at most 450 s")


def test_an_unknown_check_name_is_refused():
    result = run("--only", "triton_kernels,no_such_check")
    assert result.returncode == 2
    assert "unknown check(s) no_such_check" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path")
def test_dry_run_passes_the_kernels_on_cpu_and_skips_the_gpu_checks(tmp_path):
    result = run("--dry-run", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    checks = [line for line in lines if line.startswith("CHECK ")]
    assert [line.split()[1] for line in checks] == CHECKS  # one line per check, in order
    kernels = checks[0].split()
    assert kernels[2] == "PASS", checks[0]
    assert "float32 10/10" in checks[0] and "bfloat16 10/10" in checks[0] and "Triton interpreter" in checks[0]
    for line in checks[1:]:
        assert line.split()[2] == "SKIP" and line.endswith("needs CUDA (dry run on CPU)"), line
    assert lines[-1].startswith("gpu_check: 1 passed, 0 failed, 5 skipped (dry run on CPU")
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {c["name"]: c["status"] for c in report["checks"]} == \
        {"triton_kernels": "PASS", **{name: "SKIP" for name in GPU_ONLY}}
    assert all(row["ok"] for row in report["checks"][0]["data"]["checks"])
    assert (tmp_path / "gpu_check_logs" / "triton_kernels.log").exists()


def test_a_missing_package_is_named_with_how_to_carry_it(gpu_check, monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.REQUIRED_MODULES, "no_such_module_for_gpu_check", "no-such-dist")
    assert gpu_check.main(["--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "missing or unusable Python packages: no-such-dist (no module no_such_module_for_gpu_check)" in err
    assert "bench/gpu_check_wheels.sh" in err and 'carry [".whl"]' in err
    assert "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD" in err


def test_compare_greedy_tells_near_ties_from_real_divergences(gpu_check):
    ref = [[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]]
    ref_top = [[{5, 9}, {6, 8}, {7}]] * 4
    got = [[5, 6, 7], [5, 8, 1], [5, 4, 7], [5, 6]]
    got_top = [[{5}, {6}, {7}], [{5}, {8, 6}, {1}], [{5}, {4, 6}, {7}], [{5}, {6}]]
    c = gpu_check.compare_greedy(ref, ref_top, got, got_top)
    assert c["exact"] == 1 and c["divergences"] == [1, 1, 2]
    # prompt 1: 8 is in ref's top and 6 in got's: a near tie; prompt 2: 4 is not in ref's top
    assert c["not_near_ties"] == ["prompt 2 at token 1: 4 vs 6", "prompt 3: 2 tokens, expected 3"]
    assert c["agreed_prefix"] == 1
    one_sided = gpu_check.compare_greedy(ref[:2], ref_top[:2], got[:2])  # no top sets for `got`
    assert one_sided["not_near_ties"] == [] and one_sided["exact"] == 1


def test_each_check_is_a_module_of_its_own_with_run(gpu_check):
    assert list(gpu_check.CHECK_NAMES) == CHECKS
    for name in CHECKS:
        module = importlib.import_module(f"bench.gpu_check.checks.{name}")
        assert callable(module.run) and module.__doc__.startswith(f"{name}: "), name
