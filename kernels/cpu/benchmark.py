"""Microbenchmark (not a test): the C++ decode kernel against paged_decode_attention_ref at
SmolLM2-135M decode shapes, one call per layer, each layer with its own cache as in the engine
(so nothing stays in the CPU caches between calls). `python -m kernels.cpu.benchmark`."""
from __future__ import annotations

import time

import torch

from kernels.cpu import paged_decode_attention
from kernels.paged_attention import paged_decode_attention_ref

BATCH, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CONTEXT, NUM_LAYERS = 64, 9, 3, 64, 16, 270, 30


def main(repeats: int = 5) -> None:
    torch.manual_seed(0)
    blocks_per_seq = -(-CONTEXT // BLOCK_SIZE)
    num_blocks = BATCH * blocks_per_seq
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
    tables = torch.randperm(num_blocks).view(BATCH, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    query = torch.randn(BATCH, NUM_HEADS, HEAD_DIM)
    kernels = {"c++": paged_decode_attention, "ref": paged_decode_attention_ref}
    best: dict[tuple[int, str], float] = {}
    for _ in range(repeats):  # interleaved, best of: the machine's noise only ever adds time
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for key_cache, value_cache in caches:
                    kernel(query, key_cache, value_cache, tables, seq_lens, 0.125)
                elapsed = time.perf_counter() - start
                best[threads, name] = min(best.get((threads, name), elapsed), elapsed)
    for (threads, name), seconds in sorted(best.items()):
        print(f"{threads} thread(s) {name}: {seconds * 1e3:6.1f} ms per {NUM_LAYERS} calls")


if __name__ == "__main__":
    main()
