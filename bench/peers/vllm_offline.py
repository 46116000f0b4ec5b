"""Runs one offline workload on vLLM and prints one JSON line with its throughput.

Executed by a vLLM environment's own Python (see ../shared/peers.md), never by pdserve's:
it imports nothing of pdserve. The workload comes as a JSON file written by the caller
({"prompts": [[ids...]], "max_tokens": [n...]}), so both engines run exactly the same.

    VLLM_PY bench/peers/vllm_offline.py --model HF_DIR --workload W.json [--dtype bfloat16]
"""
import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a Hugging Face folder (vLLM reads no GGUF here)")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (vLLM-CPU's default on BF16 CPUs)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    with open(args.workload) as f:
        work = json.load(f)
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.max_num_seqs,
              tensor_parallel_size=args.tensor_parallel_size)
    load_s = time.perf_counter() - start
    warm = [TokensPrompt(prompt_token_ids=work["prompts"][0][:64])]
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("PEER_RESULT " + json.dumps({"engine": "vllm", "seconds": round(elapsed, 2), "output_tokens": tokens,
                                      "output_tok_s": round(tokens / elapsed, 2), "startup_s": round(load_s, 1),
                                      "token_ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
