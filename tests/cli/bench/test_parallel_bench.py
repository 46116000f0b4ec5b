"""bench/parallel_step.py and bench/gpu_parallel.py run: the CPU one prints a row per (t, p)
and the micro-batch overlap table on the tiny model with real ranks; the GPU one, without enough GPUs, says
so and exits 0. (What they measure is recorded in docs/benchmarks.md, not asserted here.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run(name: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"bench.{name.removesuffix('.py')}", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)


def test_parallel_step_measures_a_pipeline_of_real_ranks(tiny_llama_dir):
    # one configuration, one fresh process (each (t, p) adds one): the tables are checked below
    proc = _run("parallel_step.py", "--model", tiny_llama_dir, "--configs", "1x2", "--no-overlap", "--repeats", "1",
                "--steps", "2", "--batch-sizes", "1,4", "--prefill-tokens", "32", "--prompt-len", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert (row["t"], row["p"], row["ranks"], row["microbatches"]) == (1, 2, 2, 2)
    assert all(row[k] > 0 for k in ("prefill", "prefill_2x", "decode_1", "decode_4"))
    assert "| 1 | 2 | 2 | " in proc.stdout


def test_the_tables_give_ratios_to_one_rank_and_the_overlap_speedup(capsys):
    sys.path.insert(0, ROOT)
    from bench.parallel_step import parse_args, print_tables
    args = parse_args(["--batch-sizes", "1,32", "--prefill-tokens", "512", "--repeats", "1"])
    def row(t, p, mb, ms):
        return {"t": t, "p": p, "ranks": t * p, "microbatches": mb, "device": "cpu", "cores": 8,
                "prefill": ms, "prefill_2x": ms, "decode_1": ms / 10, "decode_32": ms / 5}
    rows = [row(1, 1, 1, 100.0), row(3, 1, 1, 50.0), row(1, 2, 2, 80.0)]
    print_tables(args, rows, (row(1, 2, 1, 120.0), rows[2]))
    out = capsys.readouterr().out
    assert "| 3 | 1 | 3 | 50.0 | 5.0 | 10.0 |" in out
    assert "| 3 | 1 | 0.50 | 0.50 | 0.50 |" in out and "| 1 | 2 | 0.80 | 0.80 | 0.80 |" in out
    assert "| prefill 2 x 256 tok | 120.0 | 80.0 | 1.50 |" in out
    assert "| decode b=32 | 24.0 | 16.0 | 1.50 |" in out


def test_gpu_parallel_without_enough_gpus_says_so_and_exits_0():
    proc = _run("gpu_parallel.py", "--configs", "1x1,3x2", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping t=3 p=2: needs 6 GPU(s), 0 visible" in proc.stdout
    assert "nothing to measure: 0 GPU(s) visible" in proc.stdout
