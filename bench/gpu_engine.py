"""The engine on a GPU, with and without CUDA graphs for decode steps (issue 12), per dtype:

    offline     tokens/s on bench/offline_throughput.py's workload: 32 requests, random prompts
                of 32-512 tokens, 16-256 output tokens, seed 0, greedy, EOS ignored
    decode      engine step time by batch size: bench/profile_step.py's decode batches (B
                requests with --prompt-len-token prompts; only steps where all B decode are
                timed), the whole EngineCore.step (schedule, inputs, forward, sample, outputs)
    agreement   whether the graph run's greedy tokens equal the eager run's. Padding a batch to
                its bucket changes the GEMM shapes, which may round differently in the last bits,
                so a late divergence on a few requests is rounding; a graph bug shows as early
                divergence on most of them.

    python -m bench.gpu_engine                          # float32 and bfloat16, graphs off and on
    python -m bench.gpu_engine --dtypes bfloat16 --graph-sizes 1,2,4,8,16,32,64

Needs CUDA (triton attention backend). Prints one JSON line per (dtype, graphs) run, then one
summary line per dtype.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.report import emit_row
from bench.offline_throughput import make_workload, run_engine
from bench.profile_step import start_decode_batch
from pdserve.engine import LLM
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.model.loader import load_model, parse_dtype
from pdserve.engine.model.source import resolve_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    parser.add_argument("--graph-sizes", default="1,2,4,8,16,32,64",
                        help="the engine's cuda_graph_batch_sizes for the graph runs")
    parser.add_argument("--batch-sizes", default="1,4,16,64", help="decode step time at these batch sizes")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of the step-time batches")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    return parser.parse_args()


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def count_graph_steps(llm: LLM) -> dict:
    """Counts the runner's steps that replayed a graph (the rest ran eagerly)."""
    counts = {"graph": 0, "eager": 0}
    graphs = llm.engine.runner.decode_graphs
    if not graphs.graphs:  # none captured
        return counts
    run = graphs.run

    def counted(batch):
        logits = run(batch)
        counts["eager" if logits is None else "graph"] += 1
        return logits
    graphs.run = counted
    return counts


def decode_step_ms(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    engine = llm.engine
    start_decode_batch(engine, batch, prompt_len, steps, seed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()  # sampling reads the tokens back: every step ends synchronized
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * elapsed / steps


def run_config(loaded, args, dtype: str, graph_sizes: list[int], workload) -> tuple[dict, list[list[int]]]:
    prompts, outputs = workload
    start = time.perf_counter()
    # Prefix caching off: the timed run repeats the warm-up's prompts (random prompts share no
    # prefix, so it changes nothing else).
    llm = LLM(args.model, dtype=dtype, device="cuda", attention_backend="triton", loaded_model=loaded,
              max_num_seqs=max(64, *int_list(args.batch_sizes)), kv_cache_memory_bytes=args.kv_cache_memory_bytes,
              enable_prefix_caching=False, cuda_graph_batch_sizes=tuple(graph_sizes), progress=False)
    start_s = time.perf_counter() - start  # KV allocation, and the graph capture when on
    # Warm-up on the same workload: Triton compiles a kernel variant on its first launch with
    # new specializations (e.g. a second split-KV partition), which must not land in a timed run.
    run_engine(llm, prompts, outputs)
    counts = count_graph_steps(llm)
    seconds, token_ids = run_engine(llm, prompts, outputs)
    offline_counts = dict(counts)
    steps = []
    for batch in int_list(args.batch_sizes):
        ms = decode_step_ms(llm, batch, args.prompt_len, args.steps, args.seed)
        steps.append({"batch": batch, "step_ms": round(ms, 3), "output_tok_s": round(1000 * batch / ms, 1)})
    row = {"dtype": dtype, "cuda_graphs": graph_sizes, "engine_start_s": round(start_s, 2),
           "offline_output_tok_s": round(sum(outputs) / seconds, 1), "offline_s": round(seconds, 3),
           "offline_steps": offline_counts, "decode": steps,
           "decode_steps": {k: counts[k] - offline_counts[k] for k in counts},
           "device": torch.cuda.get_device_name()}
    del llm
    torch.cuda.empty_cache()
    return row, token_ids


def agreement(eager: list[list[int]], graphs: list[list[int]]) -> dict:
    first_diffs = [next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), None) for e, g in zip(eager, graphs)]
    diffs = [d for d in first_diffs if d is not None]
    return {"requests_equal": len(eager) - len(diffs), "requests": len(eager),
            "earliest_divergence": min(diffs) if diffs else None}


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_engine.py: CUDA is not available on this machine; this benchmark needs a GPU "
                 "(bench/profile_step.py and bench/offline_throughput.py measure the CPU engine)")
    source = resolve_model(args.model)
    for dtype in args.dtypes.split(","):
        loaded = load_model(source, parse_dtype(dtype), "cuda", progress=False)
        workload = make_workload(loaded.arch.vocab_size, args.num_prompts, args.seed)
        eager, eager_ids = run_config(loaded, args, dtype, [], workload)
        emit_row(eager)
        graphs, graph_ids = run_config(loaded, args, dtype, int_list(args.graph_sizes), workload)
        emit_row(graphs)
        speedup = {str(e["batch"]): round(e["step_ms"] / g["step_ms"], 2)
                   for e, g in zip(eager["decode"], graphs["decode"])}
        print(json.dumps({"dtype": dtype, "summary": True,
                          "offline_speedup": round(graphs["offline_output_tok_s"] / eager["offline_output_tok_s"], 2),
                          "decode_step_speedup_by_batch": speedup,
                          "graph_tokens_vs_eager": agreement(eager_ids, graph_ids)}), flush=True)
        del loaded
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
