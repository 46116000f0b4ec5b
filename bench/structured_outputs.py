"""Structured outputs: output tok/s with and without a JSON schema, and grammar compile time.

The same chat prompts (one per request, "describe person i as JSON") on SmolLM2, float32,
greedy, at each batch size (every request of a batch given to one `generate` call). The
guided run constrains each reply to SCHEMA (a nested object, an enum, an integer range,
an array); the grammar ends each request when the object closes, so `ignore_eos` cannot
be used there. The unguided run then generates, with `ignore_eos`, exactly as many tokens
per request as the guided run did: the same batch shape step by step, so the ratio
guided/unguided (output tok/s = generated tokens / wall time) isolates the grammar's cost
(a bitmask per request per step, applied to the logits, and the matcher's advance).
Each run is repeated and the median kept, guided and unguided alternating (prefix caching
off: every run prefills its prompts, not only the first). The grammar
is compiled before the timed runs (the engine caches it by spec); its compile time is
reported on its own line: cold (a fresh GrammarCompiler: the tokenizer table, then the
first compile of the schema) and cached (the same schema again).
Prints one JSON line per batch size and one for compile times.

    .venv/bin/python -m bench.structured_outputs                                  # batch 1 and 32
    .venv/bin/python -m bench.structured_outputs --batch-sizes 1,4 --max-tokens 16 --repeats 1   # a smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.report import emit_row
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_MODEL, EngineConfig
from pdserve.engine.chat import encode_chat_prompt
from pdserve.engine.structured import StructuredOutputsParams
from pdserve.engine.structured.grammar import GrammarCompiler

# bounded strings and arrays: every reply closes well within the default max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ["engineer", "doctor", "teacher", "artist", "pilot"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"], "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
ROLES = SCHEMA["properties"]["role"]["enum"]


def make_prompts(tokenizer, batch_size: int) -> list[list[int]]:
    """Distinct chat prompts (no two share more than the template's prefix)."""
    prompts = []
    for i in range(batch_size):
        ask = (f"Invent person number {i}, a {ROLES[i % len(ROLES)]} from city {i * 7 % 50}. "
               "Reply with a JSON object with their name, age, role, address (city, zip) and skills.")
        prompts.append(encode_chat_prompt(tokenizer, [{"role": "user", "content": ask}])[1])
    return prompts


def timed_generate(llm: LLM, prompts, params) -> tuple[float, list[int]]:
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return elapsed, [len(r.token_ids) for r in results]


def run_batch(llm: LLM, batch_size: int, max_tokens: int, repeats: int) -> dict:
    prompts = make_prompts(llm.tokenizer, batch_size)
    guided_params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                   structured_outputs=StructuredOutputsParams(json=SCHEMA))
    guided_s, unguided_s, lengths = [], [], None
    for _ in range(repeats):
        seconds, got = timed_generate(llm, prompts, guided_params)
        assert lengths is None or got == lengths, "greedy guided runs differ in length"
        lengths = got
        guided_s.append(seconds)
        # the same number of tokens per request, unconstrained: the same batch shape each step
        unguided_params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        seconds, got = timed_generate(llm, prompts, unguided_params)
        assert got == lengths
        unguided_s.append(seconds)
    tokens = sum(lengths)
    guided, unguided = statistics.median(guided_s), statistics.median(unguided_s)
    guided_rate, unguided_rate = tokens / guided, tokens / unguided
    return {"batch_size": batch_size, "prompt_tokens": sum(map(len, prompts)), "output_tokens": tokens,
            "repeats": repeats, "guided_s": round(guided, 3), "unguided_s": round(unguided, 3),
            "guided_output_tok_s": round(guided_rate, 2), "unguided_output_tok_s": round(unguided_rate, 2),
            # the target: >= 0.90 at batch 32 (overhead <= 10%)
            "ratio_guided_vs_unguided": round(guided_rate / unguided_rate, 3),
            "overhead_pct": round(100 * (unguided_rate - guided_rate) / unguided_rate, 1),
            "torch_threads": torch.get_num_threads()}


def compile_times(llm: LLM) -> dict:
    """Compile the schema on a fresh compiler (nothing cached, no tokenizer table yet)."""
    engine, params = llm.engine, StructuredOutputsParams(json=SCHEMA)
    compiler = GrammarCompiler(engine.tokenizer, engine.loaded.arch.vocab_size, engine.loaded.eos_token_ids)
    try:
        start = time.perf_counter()
        compiler.prepare()  # the tokenizer table, built once per compiler (lazily, by the first compile)
        table = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(params)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(params)  # xgrammar's own cache
        cached = time.perf_counter() - start
        compiler.check(params)  # the engine's path: the compile thread, then its future cache
        start = time.perf_counter()
        compiler.check(params)
        cached_check = time.perf_counter() - start
    finally:
        compiler.close()
    return {"compile": "json_schema", "tokenizer_table_ms": round(table * 1e3, 2),
            "cold_compile_ms": round(cold * 1e3, 2), "cold_total_ms": round((table + cold) * 1e3, 2),
            "cached_compile_ms": round(cached * 1e3, 3), "cached_check_ms": round(cached_check * 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated")
    parser.add_argument("--max-tokens", type=int, default=160, help="a guided reply's limit (the schema closes sooner)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; the median is kept")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch.set_num_threads")
    parser.add_argument("--device", default=EngineConfig.device)
    parser.add_argument("--attention-backend", default=EngineConfig.attention_backend)
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    llm = LLM(DEFAULT_MODEL, device=args.device, attention_backend=args.attention_backend,
              max_num_seqs=max(batch_sizes), enable_prefix_caching=False, progress=False)
    emit_row(compile_times(llm))  # before the engine's compiler touches xgrammar
    # warm-up: the engine's grammar (compiled and cached by spec) and both paths' first calls
    warm = make_prompts(llm.tokenizer, 1)
    llm.generate({"prompt_token_ids": warm[0]}, SamplingParams(temperature=0, max_tokens=8,
                                                               structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    llm.generate({"prompt_token_ids": warm[0]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for batch_size in batch_sizes:
        emit_row(run_batch(llm, batch_size, args.max_tokens, args.repeats))


if __name__ == "__main__":
    main()
