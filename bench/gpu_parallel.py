"""bench/parallel_step.py on GPUs: engine step time by tensor (t) and pipeline (p) parallel
size with device cuda, the triton attention backend and NCCL between the ranks (the
engine's backend on CUDA), bfloat16, rank r on cuda:r. The same workloads and tables:
a prefill step (--prefill-tokens, 2048 here), all-decode steps at batch 1/8/32, and the
p=2 micro-batch overlap.

    python -m bench.gpu_parallel                           # every (t, p) of 1x1,3x1,1x2,3x2 that fits
    python -m bench.gpu_parallel --configs 1x1,2x1,1x2 --model /models/llama-8b   # t must divide the KV heads

A configuration needs t x p visible GPUs; those that do not fit are named and skipped, and
with no GPU (or too few for any of them) it says so and exits 0, measuring nothing.
"""
from __future__ import annotations

import sys

from bench.parallel_step import child_main, parse_args, parse_configs, run_all


def visible_gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv, device="cuda")
    if args.one:
        return child_main(args)
    configs = parse_configs(args.configs)
    gpus = visible_gpus()
    fits = [(t, p) for t, p in configs if t * p <= gpus]
    for t, p in configs:
        if t * p > gpus:
            print(f"bench/gpu_parallel.py: skipping t={t} p={p}: needs {t * p} GPU(s), {gpus} visible", flush=True)
    if not fits:
        print(f"bench/gpu_parallel.py: nothing to measure: {gpus} GPU(s) visible, fewer than any configuration "
              f"of --configs {args.configs} needs (bench/parallel_step.py measures the CPU engine)", flush=True)
        return 0
    return run_all(args, "bench.gpu_parallel", argv, fits)


if __name__ == "__main__":
    sys.exit(main())
