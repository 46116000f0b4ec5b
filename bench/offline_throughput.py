"""Offline throughput: pdserve's engine against Hugging Face transformers `generate`.

64 prompts of mixed lengths (32-512 prompt tokens, 16-256 output tokens, fixed seed) on
SmolLM2, greedy, every request generating exactly its target length (EOS ignored on both
sides). transformers runs left-padded batches of the same concurrency as the engine's
max_num_seqs; only each prompt's own target tokens count as useful output for both.
Prints one JSON line with both rates and `ratio_vs_hf`.

    .venv/bin/python bench/offline_throughput.py [--num-prompts 64 --concurrency 64]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import DEFAULT_MODEL  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model.source import resolve_model  # noqa: E402


def make_workload(vocab_size: int, num_prompts: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(num_prompts)]
    outputs = [rng.randint(16, 256) for _ in range(num_prompts)]
    return prompts, outputs


def run_engine(llm: LLM, prompts, outputs) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == outputs
    return elapsed, sum(outputs)


@torch.inference_mode()
def run_hf(path: str, prompts, outputs, concurrency: int, pad_id: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate every target token, as the engine does
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch, targets = prompts[i:i + concurrency], outputs[i:i + concurrency]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(ids, attention_mask=mask, max_new_tokens=max(targets), min_new_tokens=max(targets),
                       do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start, sum(outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64, help="engine max_num_seqs = HF batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    llm = LLM(DEFAULT_MODEL, max_num_seqs=args.concurrency, progress=False)
    prompts, outputs = make_workload(llm.engine.loaded.arch.vocab_size, args.num_prompts, args.seed)
    engine_s, tokens = run_engine(llm, prompts, outputs)
    result = {"num_prompts": args.num_prompts, "concurrency": args.concurrency,
              "prompt_tokens": sum(map(len, prompts)), "output_tokens": tokens,
              "engine_s": round(engine_s, 2), "engine_output_tok_s": round(tokens / engine_s, 2),
              "torch_threads": torch.get_num_threads()}
    if not args.skip_hf:
        del llm
        hf_s, _ = run_hf(resolve_model(DEFAULT_MODEL).path, prompts, outputs, args.concurrency, pad_id=2)
        result.update(hf_s=round(hf_s, 2), hf_output_tok_s=round(tokens / hf_s, 2),
                      ratio_vs_hf=round(hf_s / engine_s, 2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
