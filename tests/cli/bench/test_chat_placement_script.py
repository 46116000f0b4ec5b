"""bench/serve_chat_placement.py end to end on the tiny model with a tiny workload: each
placement's platform starts, every turn completes, the JSON has what docs/benchmarks.md
quotes. (What it measures is recorded there, not asserted here.)"""
from __future__ import annotations

from tests.cli.bench.test_experiment_scripts import run_script


def test_chat_placement_experiment(tiny_llama_dir, tmp_path):
    out = run_script("serve_chat_placement.py", "--model", tiny_llama_dir, "--placements", "kv,affinity",
                     "--conversations", "2", "--turns", "2", "--system-len", "48", "--user-len", "16",
                     "--output-len", "3", "--short-prompt-tokens", "16", "--result-dir", str(tmp_path))
    for placement in ("kv", "affinity"):
        row = out[placement]
        assert row["turns_completed"] == 4 and not row["errors"]
        assert sum(row["requests_per_worker"].values()) == 4 and set(row["requests_per_worker"]) == {
            "prefill-0", "prefill-1"}
        assert 0 < row["prefix_hit_rate"] <= 1 and row["ttft_ms"]["mean"] > 0
    assert set(out["kv"]["placement_reasons"]) <= {"kv_hit", "kv_host_hit", "kv_load_over_hit", "least_loaded"}
    assert set(out["affinity"]["placement_reasons"]) <= {"affinity", "affinity_overload", "least_loaded"}
