"""cuda_graphs_vs_eager: the engine with CUDA graphs for decode against eager, same tokens on
bench/offline_throughput.py's workload."""
from __future__ import annotations

from bench.gpu_check.context import GRAPH_SIZES, Ctx, free, make_llm, workload
from bench.gpu_check.greedy import agreement_text, compare_greedy, greedy_with_logprobs


def run(ctx: Ctx):
    """Eager against graphs (sizes 1..64) on bench/offline_throughput.py's workload with logprobs:
    PASS when the graph run replayed graphs and every divergence is a near tie (a batch padded
    to its bucket, and the graphs' split-KV over max_model_len, round differently)."""
    from bench.gpu_engine import count_graph_steps
    prompts, outputs = workload(ctx)
    runs = {}
    for graphs in ((), GRAPH_SIZES):
        llm = make_llm(ctx, graphs, max_num_seqs=64, enable_prefix_caching=False)
        counts = count_graph_steps(llm)
        runs[bool(graphs)] = (*greedy_with_logprobs(llm, prompts, outputs), counts)
        del llm
        free()
    (e_tokens, e_tops, _, _), (g_tokens, g_tops, _, counts) = runs[False], runs[True]
    c = compare_greedy(e_tokens, e_tops, g_tokens, g_tops)
    ok = counts["graph"] > 0 and not c["not_near_ties"]
    detail = (f"{agreement_text(c, 'requests')} ({sum(outputs)} tokens); graph run: {counts['graph']} steps "
              f"replayed, {counts['eager']} eager; sizes {','.join(map(str, GRAPH_SIZES))}")
    if counts["graph"] == 0:
        detail += "; NO step replayed a graph"
    return ("PASS" if ok else "FAIL"), detail, {**c, "graph_steps": counts}
