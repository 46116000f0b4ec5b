"""Offline throughput: pdserve's engine against vLLM-CPU (the peer a user would pick) and
Hugging Face transformers `generate`, on the same workload in the same run.

N prompts of mixed lengths (32-512 prompt tokens, 16-256 output tokens, fixed seed) on
SmolLM2, float32, greedy, every request generating exactly its target length (EOS ignored
on every side), all given to one `generate` call. transformers runs left-padded batches of
the same concurrency as the engine's max_num_seqs; only each prompt's own target tokens
count as useful output. vLLM runs in its own environment (../shared/peers.md) through
bench/peers/vllm_offline.py, on an HF folder of the same model (saved by this script).
Prints one JSON line with every rate, `ratio_vs_vllm` and `ratio_vs_hf`.

    .venv/bin/python -m bench.offline_throughput --num-prompts 32 --vllm-python $TMPDIR/vllm-peer/bin/python
    .venv/bin/python -m bench.offline_throughput                 # 64 prompts, pdserve vs transformers
    .venv/bin/python -m bench.offline_throughput --num-prompts 16 --skip-hf --tensor-parallel-size 3 \
        --vllm-python $TMPDIR/vllm-peer/bin/python               # both engines at t = 3 (3 ranks each)
    .venv/bin/python -m bench.offline_throughput --num-prompts 32 --dtype bfloat16 --skip-hf \
        --vllm-python $TMPDIR/vllm-peer/bin/python --agreement-prompts 16

`--dtype bfloat16` runs both engines in bf16 (weights and KV cache: vLLM-CPU's default on
CPUs with AVX512-BF16 or AMX). Greedy bf16 decoding of two implementations diverges once
rounding flips an argmax, so `--agreement-prompts N` also reports how the engine agrees
with transformers in the same dtype: each of the first N prompts generated alone (no
padding) by both, 64 tokens; the share of requests with identical tokens and where the
others first differ.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time

import torch

from bench.report import emit_result
from bench.machine import read_cpu_flags
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.source import resolve_model


def make_workload(vocab_size: int, num_prompts: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(num_prompts)]
    outputs = [rng.randint(16, 256) for _ in range(num_prompts)]
    return prompts, outputs


def agreement_with_hf(llm: LLM, hf_dir: str, prompts, dtype: torch.dtype, max_tokens: int = 64) -> dict:
    """How the engine's greedy tokens agree with transformers' in `dtype`, prompt by prompt."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = [r.token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    first_differences = []
    with torch.inference_mode():
        for prompt, mine in zip(prompts, ours):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
            theirs = out[0, len(prompt):].tolist()
            first_differences.append(next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None))
    differing = sorted(i for i in first_differences if i is not None)
    return {"agreement_prompts": len(prompts), "agreement_tokens": max_tokens,
            "identical_share": round(first_differences.count(None) / len(prompts), 3),
            "first_difference_positions": differing}


def run_engine(llm: LLM, prompts, outputs) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == outputs
    return elapsed, [r.token_ids for r in results]


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


def save_hf_folder(gguf_path: str, out_dir: str) -> str:
    """vLLM reads Hugging Face folders: the embedded GGUF, dequantized, saved once."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    return out_dir


def run_vllm(python: str, hf_dir: str, prompts, outputs, threads: int, tensor_parallel_size: int = 1,
             dtype: str = "float32") -> dict:
    """vLLM in a subprocess of its own environment; its JSON line starts with PEER_RESULT."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "vllm_offline.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "max_tokens": outputs}, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([python, script, "--model", hf_dir, "--workload", f.name,
                           "--tensor-parallel-size", str(tensor_parallel_size), "--dtype", dtype], env=env, capture_output=True, text=True)
    os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PEER_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("PEER_RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64, help="engine max_num_seqs = HF batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="both engines' (not transformers')")
    parser.add_argument("--vllm-python", default=None, help="a vLLM environment's python: also run vLLM")
    parser.add_argument("--hf-dir", default=os.path.join(tempfile.gettempdir(), "pdserve-smollm2-hf"),
                        help="where the HF folder vLLM reads is saved (once)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines'")
    parser.add_argument("--agreement-prompts", type=int, default=0,
                        help="also compare greedy tokens with transformers in --dtype on this many prompts")
    args = parser.parse_args()
    if args.dtype != "float32" and not args.skip_hf:
        parser.error("--dtype: the transformers throughput run is float32 only; add --skip-hf")
    torch.manual_seed(args.seed)
    llm = LLM(DEFAULT_MODEL, max_num_seqs=args.concurrency, progress=False,
              tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype)
    prompts, outputs = make_workload(llm.engine.loaded.arch.vocab_size, args.num_prompts, args.seed)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:64]}, warm)  # as vLLM is warmed up: no request pays start-up
    engine_s, engine_ids = run_engine(llm, prompts, outputs)
    tokens = sum(outputs)
    result = {"num_prompts": args.num_prompts, "concurrency": args.concurrency, "dtype": args.dtype,
              "cpu": read_cpu_flags(),
              "tensor_parallel_size": args.tensor_parallel_size,
              "prompt_tokens": sum(map(len, prompts)), "output_tokens": tokens,
              "engine_s": round(engine_s, 2), "engine_output_tok_s": round(tokens / engine_s, 2),
              "torch_threads": torch.get_num_threads()}
    if args.vllm_python:
        hf_dir = save_hf_folder(resolve_model(DEFAULT_MODEL).path, args.hf_dir)
        peer = run_vllm(args.vllm_python, hf_dir, prompts, outputs, torch.get_num_threads(), args.tensor_parallel_size,
                        args.dtype)
        result.update(vllm_s=peer["seconds"], vllm_output_tok_s=peer["output_tok_s"],
                      ratio_vs_vllm=round(peer["seconds"] / engine_s, 2),
                      # greedy float32 on both: requests whose tokens agree exactly (kernels differ in rounding)
                      same_tokens_as_vllm=sum(a == b for a, b in zip(engine_ids, peer["token_ids"])))
    if args.agreement_prompts:
        hf_dir = save_hf_folder(resolve_model(DEFAULT_MODEL).path, args.hf_dir)
        result.update(agreement_with_hf(llm, hf_dir, prompts[:args.agreement_prompts], getattr(torch, args.dtype)))
    if args.tensor_parallel_size > 1:
        llm.engine.shutdown()
    if not args.skip_hf:
        del llm
        hf_s, _ = run_hf(resolve_model(DEFAULT_MODEL).path, prompts, outputs, args.concurrency, pad_id=2)
        result.update(hf_s=round(hf_s, 2), hf_output_tok_s=round(tokens / hf_s, 2),
                      ratio_vs_hf=round(hf_s / engine_s, 2))
    emit_result(result)


if __name__ == "__main__":
    main()
