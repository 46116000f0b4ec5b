"""The checks, in the order they run: each a module of this package whose run(ctx) returns
(status, detail, data), in a process of its own (bench/gpu_check/parent.py starts it)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    budget_s: int       # the check's own process is killed past this
    cpu_dry_run: bool   # runs in --dry-run (on CPU); the others need CUDA
    summary: str


CHECKS = (
    Check("triton_kernels", 100, True,
          "Triton paged attention + KV-cache write vs torch references, float32 and bfloat16"),
    Check("engine_vs_transformers_bf16", 90, False,
          "engine bf16 greedy vs transformers bf16 on the same GPU (tokens; logprobs vs fp32)"),
    Check("cuda_graphs_vs_eager", 90, False, "engine with CUDA graphs vs eager: same tokens, graphs replayed"),
    Check("pd_up_one_gpu", 150, False,
          "`pdserve up`, 1 prefill + 1 decode worker on the GPU: router tokens vs the offline engine"),
    Check("decode_step_time", 75, False, "decode step time by batch 1/8/32/64, eager and graphs (bf16)"),
    Check("offline_tokens_per_s", 90, False, "offline output tokens/s, 32 requests, eager and graphs (bf16)"),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)


def run_check_here(name: str, ctx):
    """Runs check `name` in this process: its module's run(ctx)."""
    return importlib.import_module(f"{__name__}.{name}").run(ctx)
