"""offline_tokens_per_s: offline output tokens/s on bench/offline_throughput.py's workload
(32 requests, bfloat16, eager and graphs)."""
from __future__ import annotations

from bench.gpu_check.context import GRAPH_SIZES, Ctx, free, make_llm, workload


def run(ctx: Ctx):
    """bench/offline_throughput.py's workload (32 requests, 32-512 prompt tokens, 16-256 output
    tokens, greedy, EOS ignored) through bench/offline_throughput.run_engine, a warm-up run
    first (Triton compiles), eager and with graphs."""
    from bench.offline_throughput import run_engine
    prompts, outputs = workload(ctx)
    rates = {}
    for graphs in ((), GRAPH_SIZES):
        llm = make_llm(ctx, graphs, max_num_seqs=64, enable_prefix_caching=False)
        run_engine(llm, prompts, outputs)
        seconds, _ = run_engine(llm, prompts, outputs)
        rates["graphs" if graphs else "eager"] = round(sum(outputs) / seconds, 1)
        del llm
        free()
    ok = all(r > 0 for r in rates.values())
    detail = (f"eager {rates['eager']:.0f} tok/s, graphs {rates['graphs']:.0f} tok/s "
              f"(x{rates['graphs'] / rates['eager']:.2f}; {len(prompts)} requests, {sum(outputs)} output tokens, bf16)")
    return ("PASS" if ok else "FAIL"), detail, {**rates, "requests": len(prompts), "output_tokens": sum(outputs)}
