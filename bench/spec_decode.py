"""Speculative decoding: output tok/s with and without it, n-gram and draft-model proposers.

SmolLM2, float32, greedy, on two workloads of chat prompts, at each batch size (every
request of a batch given to one `generate` call):
  repetitive  answers that copy the prompt: "repeat this code exactly", "repeat this
              list" (what n-gram lookup in the request's own tokens is for: code edits,
              extraction, quotes; SmolLM2-135M copies these, not longer spans)
  random      ordinary questions, whose answers copy little
Three engines over the same weights, in the same sitting: no speculation (the baseline),
n-gram (k=4, lookup 1..4, vLLM's prompt_lookup_min/max) and draft_model with SmolLM2 as
its own draft (k=3: every draft is accepted, so it measures the machinery's cost and the
upper bound of a draft that is always right, not a useful pairing). Each run lets the
requests stop at EOS: greedy speculation is exact, so every engine generates the same
tokens (`identical_outputs` counts the requests whose tokens match the baseline's) and
output tok/s (generated tokens / wall time, prefill included) compares like with like.
Runs alternate baseline / proposer and the median of `--repeats` is kept (prefix caching
off: every run prefills its prompts). Acceptance rate = accepted / proposed draft tokens;
mean accepted length = accepted draft tokens per verification (per request per step with
drafts), from the engine's counters over the timed runs.
Prints one JSON line per (workload, batch size, proposer). The issue's targets: ratio >= 2
at batch 1 on the repetitive workload with n-gram, >= 0.95 on the random one.

    .venv/bin/python -m bench.spec_decode                         # batch 1 and 16, both workloads
    .venv/bin/python -m bench.spec_decode --batch-sizes 1,2 --max-tokens 24 --repeats 1 \\
        --proposers ngram           # a smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.report import emit_row
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.chat import encode_chat_prompt
from pdserve.engine.config import DEFAULT_MODEL, EngineConfig

PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "draft_model": {"method": "draft_model", "model": DEFAULT_MODEL, "num_speculative_tokens": 3},
    # the same, turned off for steps with more than 8 running requests (vLLM's disable_by_batch_size)
    "ngram_small_batches": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 4, "disable_by_batch_size": 8},
}
KV_CACHE_BYTES = 768 << 20  # per engine: 16 requests of ~700 tokens, with room (SmolLM2 f32: 46 KB/token)

# SmolLM2-135M copies a short function or a list exactly (~80% of n-gram drafts accepted);
# longer code or "copy two lines of this record" it paraphrases after a few lines
CODE = '''def area_of_room_{i}(width, length):
    """The floor area of room {i}, in square metres."""
    if width <= 0 or length <= 0:
        raise ValueError("width and length must be positive")
    return width * length'''
GROCERIES = ["apples", "loaf of bread", "eggs", "carrots", "bottle of milk", "tomatoes", "onions", "bag of rice",
             "lemons", "jar of honey", "potatoes", "bananas"]
QUESTIONS = [
    "What are the main benefits of regular exercise?", "Explain how a rainbow forms.",
    "Why do leaves change colour in autumn?", "Give some tips for learning a new language.",
    "How does a refrigerator keep food cold?", "What is the difference between weather and climate?",
    "Describe how bees make honey.", "Why is sleep important for health?",
    "How do airplanes stay in the air?", "What causes the seasons on Earth?",
    "Suggest a few ideas for a rainy weekend.", "How does recycling help the environment?",
    "What makes a good team leader?", "Explain what a volcano is.",
    "Why do we need to drink water?", "How can I improve my handwriting?",
]


def repetitive_prompt(i: int) -> str:
    """Even i: repeat a short function; odd i: repeat a shopping list (names and numbers
    vary with i, so no two prompts of a batch are the same)."""
    if i % 2 == 0:
        return ("Repeat the following Python code exactly, without any explanation.\n\n```python\n"
                + CODE.format(i=i) + "\n```")
    items = "\n".join(f"- {1 + (i + k) % 6} {item}" for k, item in enumerate(GROCERIES))
    return "Repeat this shopping list exactly:\n\n" + items


WORKLOADS = {"repetitive": repetitive_prompt, "random": lambda i: QUESTIONS[i % len(QUESTIONS)]}


def make_prompts(tokenizer, workload: str, batch_size: int) -> list[list[int]]:
    return [encode_chat_prompt(tokenizer, [{"role": "user", "content": WORKLOADS[workload](i)}])[1]
            for i in range(batch_size)]


def timed_generate(llm: LLM, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return elapsed, [list(r.token_ids) for r in results]


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return s.num_spec_proposed_tokens, s.num_spec_accepted_tokens, s.num_spec_verifications


def compare(base: LLM, spec: LLM, prompts, max_tokens: int, repeats: int) -> dict:
    """Baseline and speculative runs, alternating; the medians, the spec counters' increase."""
    base_s, spec_s, outputs = [], [], None
    before = spec_counts(spec)
    for _ in range(repeats):
        seconds, outputs = timed_generate(base, prompts, max_tokens)
        base_s.append(seconds)
        seconds, spec_outputs = timed_generate(spec, prompts, max_tokens)
        spec_s.append(seconds)
    proposed, accepted, verifications = (a - b for a, b in zip(spec_counts(spec), before))
    tokens = sum(map(len, outputs))
    spec_tokens = sum(map(len, spec_outputs))
    base_rate, spec_rate = tokens / statistics.median(base_s), spec_tokens / statistics.median(spec_s)
    return {"prompt_tokens": sum(map(len, prompts)), "output_tokens": tokens, "spec_output_tokens": spec_tokens,
            "identical_outputs": sum(a == b for a, b in zip(outputs, spec_outputs)),
            "baseline_output_tok_s": round(base_rate, 2), "spec_output_tok_s": round(spec_rate, 2),
            "ratio_vs_baseline": round(spec_rate / base_rate, 3),
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "mean_accepted_length": round(accepted / verifications, 3) if verifications else None,
            "proposed_tokens": proposed, "accepted_tokens": accepted, "verifications": verifications}


def make_engine(args, loaded, speculative_config: dict | None, max_num_seqs: int) -> LLM:
    return LLM(DEFAULT_MODEL, device=args.device, attention_backend=args.attention_backend,
               max_num_seqs=max_num_seqs, enable_prefix_caching=False, kv_cache_memory_bytes=KV_CACHE_BYTES,
               speculative_config=speculative_config, loaded_model=loaded, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated")
    parser.add_argument("--workloads", default="repetitive,random", help=f"comma-separated, of {list(WORKLOADS)}")
    parser.add_argument("--proposers", default="ngram,draft_model", help=f"comma-separated, of {list(PROPOSERS)}")
    parser.add_argument("--max-tokens", type=int, default=256, help="per request (most stop at EOS sooner)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; the median is kept")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch.set_num_threads")
    parser.add_argument("--device", default=EngineConfig.device)
    parser.add_argument("--attention-backend", default=EngineConfig.attention_backend)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    workloads, proposers = args.workloads.split(","), args.proposers.split(",")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = make_engine(args, None, None, max(batch_sizes))
    engines = {name: make_engine(args, base.engine.loaded, PROPOSERS[name], max(batch_sizes)) for name in proposers}
    warm = make_prompts(base.tokenizer, "repetitive", 1)
    for llm in (base, *engines.values()):  # first calls (allocations, kernels) outside the timed runs
        timed_generate(llm, warm, 8)
    for workload in workloads:
        for batch_size in batch_sizes:
            prompts = make_prompts(base.tokenizer, workload, batch_size)
            for name, llm in engines.items():
                row = {"workload": workload, "batch_size": batch_size, "proposer": name,
                       "speculative_config": PROPOSERS[name], "repeats": args.repeats}
                row.update(compare(base, llm, prompts, args.max_tokens, args.repeats))
                row["torch_threads"] = torch.get_num_threads()
                emit_row(row)


if __name__ == "__main__":
    main()
