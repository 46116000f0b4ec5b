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
        assert set(row["reused_tokens_by_tier"]) == {"device", "host", "kvstore"}
        assert row["reused_tokens_by_tier"]["device"] > 0
    assert set(out["kv"]["placement_reasons"]) <= {"kv_hit", "kv_host_hit", "kv_load_over_hit", "least_loaded"}
    assert set(out["affinity"]["placement_reasons"]) <= {"affinity", "affinity_overload", "least_loaded"}


def test_cache_pressure_experiment(tiny_llama_dir, tmp_path):
    """bench/serve_cache_pressure.py: a fresh colocated platform per placement, the same
    tenant trace through each, every request answered."""
    out = run_script("serve_cache_pressure.py", "--model", tiny_llama_dir, "--placements", "kv,least_loaded",
                     "--tenants", "2", "--prefix-len", "48", "--question-len", "8", "--output-len", "3",
                     "--num-requests", "4", "--request-rate", "4", "--kv-cache-tokens", "256",
                     "--short-prompt-tokens", "16", "--result-dir", str(tmp_path))
    assert out["prefixes_over_one_cache"] == round(2 * 48 / 256, 2)
    for placement in ("kv", "least_loaded"):
        row = out[placement]
        assert row["completed"] == 4 and row["failed"] == 0 and not row["errors"]
        assert sum(row["requests_per_worker"].values()) == 4 and set(row["requests_per_worker"]) == {
            "decode-0", "decode-1"}
        assert row["ttft_ms"]["p90"] > 0 and row["output_tok_s"] > 0
    assert set(out["least_loaded"]["placement_reasons"]) == {"most_room"}  # the decode pool's load-only name
