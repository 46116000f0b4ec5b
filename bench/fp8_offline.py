"""fp8 weights against the same model's float32 and bfloat16 (issue 51): SmolLM2 quantized to
the `fp8` checkpoint format per output channel (bench/fp8_checkpoints.py, from the HF folder
bench/offline_throughput.py saves), then offline decode-heavy runs of each in the same
sitting: N prompts of 64 tokens generating 128 each, all in one `generate` call, at several
concurrencies (max_num_seqs). Batches of 1-4 rows take the C++ decode kernels (float32's
skinny_linear, fp8's skinny_linear_fp8: a quarter of the bytes); larger ones oneDNN (fp8:
dequantized per call). Also the weights' bytes in memory, and whether fp8's greedy tokens
equal float32's on the dequantized weights (they should: the same float32 weights).

    .venv/bin/python -m bench.fp8_offline [--concurrency 1,4,32,64] [--num-prompts 64]
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch

from bench.fp8_checkpoints import write_fp8_folders
from bench.machine import read_cpu_flags
from bench.report import emit_result
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine.model.loader import weight_bytes
from pdserve.engine.model.source import resolve_model

PROMPT_TOKENS, OUTPUT_TOKENS = 64, 128


def random_prompts(rng: random.Random, concurrency: int, num_prompts: int) -> list[list[int]]:
    """At least `concurrency` prompts of PROMPT_TOKENS random ids (up to 4 a slot, `num_prompts` at most)."""
    n = max(concurrency, min(num_prompts, 4 * concurrency))
    return [[rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def tokens_per_s(model: str, dtype: str, concurrency: int, prompts: list[list[int]],
                 quantization: str | None = None) -> tuple[float, list, int]:
    """Output tokens/s of one `generate` over all `prompts`, their token ids, the weights' bytes."""
    llm = LLM(model, dtype=dtype, quantization=quantization, max_num_seqs=concurrency, progress=False)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:concurrency]], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    return (sum(len(o.token_ids) for o in outs) / elapsed, [o.token_ids for o in outs],
            weight_bytes(llm.engine.loaded.model))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,32,64")
    p.add_argument("--num-prompts", type=int, default=64, help="per concurrency: at least the concurrency")
    p.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-smollm2-hf"))
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-smollm2-fp8"))
    args = p.parse_args()
    from bench.offline_throughput import save_hf_folder
    save_hf_folder(resolve_model(DEFAULT_MODEL).path, args.hf_dir)
    fp8_dir, dequantized_dir = os.path.join(args.out_dir, "fp8"), os.path.join(args.out_dir, "dequantized")
    write_fp8_folders(args.hf_dir, fp8_dir, dequantized_dir, "channel")
    rng = random.Random(0)
    result: dict = {"rows": {}}
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        prompts = random_prompts(rng, concurrency, args.num_prompts)
        row, tokens = {}, {}
        for name, model, dtype in (("fp32", dequantized_dir, "float32"), ("bf16", dequantized_dir, "bfloat16"),
                                   ("fp8", fp8_dir, "float32")):
            rate, tokens[name], row[f"{name}_weight_mib"] = tokens_per_s(model, dtype, concurrency, prompts)
            row[f"{name}_tok_s"] = round(rate, 1)
            row[f"{name}_weight_mib"] = round(row[f"{name}_weight_mib"] / 2**20, 1)
            print(name, concurrency, row[f"{name}_tok_s"], flush=True)
        row.update(fp8_vs_fp32=round(row["fp8_tok_s"] / row["fp32_tok_s"], 2),
                   fp8_vs_bf16=round(row["fp8_tok_s"] / row["bf16_tok_s"], 2),
                   fp8_tokens_equal_fp32=tokens["fp8"] == tokens["fp32"], requests=len(prompts))
        result["rows"][f"concurrency {concurrency}"] = row
    result.update(cpu=read_cpu_flags(), threads=torch.get_num_threads())
    emit_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
