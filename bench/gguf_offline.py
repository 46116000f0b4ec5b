"""The embedded SmolLM2 computed in its own GGUF blocks (`--quantization gguf`: Q4_1
projections, a Q8_0 embedding and LM head) against the same file dequantized to float32 and
bfloat16 (issue 51), in one sitting: offline decode-heavy runs (N prompts of 64 tokens
generating 128 each, one `generate` call) at several concurrencies, and the time of one
prefill of a long prompt. Also the weights' bytes in memory, and whether the GGUF run's
greedy tokens equal float32's (they should: the same float32 weights, multiplied in the same
order by the row kernel; larger batches multiply the dequantized weight with another GEMM).

    .venv/bin/python -m bench.gguf_offline [--concurrency 1,2,4,32] [--prefill-tokens 512]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from bench.fp8_offline import OUTPUT_TOKENS, PROMPT_TOKENS, random_prompts, tokens_per_s
from bench.machine import read_cpu_flags
from bench.report import emit_result
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL

RUNS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "gguf": ("float32", "gguf")}


def prefill_ms(dtype: str, quantization: str | None, tokens: int, repeats: int = 3) -> float:
    """One prompt of `tokens` tokens prefilled alone (prefix caching off), best of `repeats`."""
    llm = LLM(DEFAULT_MODEL, dtype=dtype, quantization=quantization, enable_prefix_caching=False, progress=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(1)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        best = min(best, time.perf_counter() - start)
    return round(best * 1000, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,2,4,32")
    p.add_argument("--num-prompts", type=int, default=32, help="per concurrency: at least the concurrency")
    p.add_argument("--prefill-tokens", type=int, default=512)
    args = p.parse_args()
    rng = random.Random(0)
    result: dict = {"rows": {}}
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        prompts = random_prompts(rng, concurrency, args.num_prompts)
        row, tokens = {}, {}
        for name, (dtype, quantization) in RUNS.items():
            rate, tokens[name], weights = tokens_per_s(DEFAULT_MODEL, dtype, concurrency, prompts, quantization)
            row[f"{name}_tok_s"], row[f"{name}_weight_mib"] = round(rate, 1), round(weights / 2**20, 1)
            print(name, concurrency, row[f"{name}_tok_s"], flush=True)
        row.update(gguf_vs_fp32=round(row["gguf_tok_s"] / row["fp32_tok_s"], 2),
                   gguf_vs_bf16=round(row["gguf_tok_s"] / row["bf16_tok_s"], 2),
                   gguf_tokens_equal_fp32=tokens["gguf"] == tokens["fp32"], requests=len(prompts),
                   tokens_each=f"{PROMPT_TOKENS} in / {OUTPUT_TOKENS} out")
        result["rows"][f"concurrency {concurrency}"] = row
    prefill = {name: prefill_ms(dtype, quantization, args.prefill_tokens) for name, (dtype, quantization) in RUNS.items()}
    result["prefill_ms"] = {**prefill, "tokens": args.prefill_tokens,
                            "gguf_vs_fp32": round(prefill["gguf"] / prefill["fp32"], 2)}
    result.update(cpu=read_cpu_flags(), threads=torch.get_num_threads())
    emit_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
