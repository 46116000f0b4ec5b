"""The cache-pressure benchmark's trace and sizing: every tenant's requests share exactly
its system prompt, the order is shuffled (not round-robin), and the per-worker cache is
sized in the engine's own bytes per token."""
from __future__ import annotations

from bench.serve_cache_pressure import kv_bytes_per_token, parse_args, tenant_trace


def test_the_trace_gives_each_tenant_one_prefix_in_a_shuffled_order():
    args = parse_args(["--tenants", "4", "--prefix-len", "48", "--question-len", "8", "--num-requests", "20"])
    trace = tenant_trace(args)
    prefixes = [r.prompt[:48] for r in trace]
    assert len(set(prefixes)) == 4
    assert all(len(r.prompt) == 56 and r.prompt_len == 56 for r in trace)
    assert len({r.prompt[48:] for r in trace}) == 20  # every question is its own
    tenant_of = {p: i for i, p in enumerate(dict.fromkeys(prefixes))}
    order = [tenant_of[p] for p in prefixes]
    assert order != [i % 4 for i in range(20)] and sorted(order) == sorted(i % 4 for i in range(20))


def test_bytes_per_token_follow_the_model_and_dtype():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, K and V
    assert kv_bytes_per_token("smollm2", "float32") == 30 * 2 * 3 * 64 * 4
    assert kv_bytes_per_token("smollm2", "bfloat16") == 30 * 2 * 3 * 64 * 2
