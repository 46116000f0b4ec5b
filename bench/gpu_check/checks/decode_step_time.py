"""decode_step_time: engine step time of all-decode batches (bfloat16, eager and graphs;
bench/gpu_engine.py's measurement)."""
from __future__ import annotations

import math

from bench.gpu_check.context import GRAPH_SIZES, Ctx, free, make_llm

DECODE_BATCHES = (1, 8, 32, 64)


def run(ctx: Ctx):
    """bench/gpu_engine.py's decode_step_ms: B requests of 256-token prompts, only all-decode
    steps timed (the whole EngineCore.step), eager and with graphs. PASS: every time measured
    and the graph engine's timed steps replayed graphs."""
    import torch

    from bench.gpu_engine import count_graph_steps, decode_step_ms
    if not ctx.cuda:
        torch.cuda.synchronize = lambda *a: None  # decode_step_ms synchronizes CUDA
    batches = DECODE_BATCHES if ctx.cuda else (1, 3)
    prompt_len, steps = (256, 30) if ctx.cuda else (20, 3)
    rows = {}
    replayed = 0
    for graphs in ((), GRAPH_SIZES):
        llm = make_llm(ctx, graphs, max_num_seqs=64, enable_prefix_caching=False,
                       kv_cache_memory_bytes=(2 << 30) if ctx.cuda else (64 << 20))
        counts = count_graph_steps(llm)
        rows["graphs" if graphs else "eager"] = [round(decode_step_ms(llm, b, prompt_len, steps, 0), 3)
                                                 for b in batches]
        if graphs:
            replayed = counts["graph"]
        del llm
        free()
    ms = rows["eager"] + rows["graphs"]
    ok = all(math.isfinite(m) and m > 0 for m in ms) and replayed >= steps * len(batches)
    detail = "ms/step eager|graphs: " + ", ".join(
        f"b{b} {e:.2f}|{g:.2f}" for b, e, g in zip(batches, rows["eager"], rows["graphs"]))
    detail += f" (bf16, {prompt_len}-token prompts, {steps} steps each; {replayed} graph replays)"
    return ("PASS" if ok else "FAIL"), detail, {"batches": list(batches), **rows, "graph_replays": replayed}
