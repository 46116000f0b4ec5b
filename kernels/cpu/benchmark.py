"""Microbenchmark (not a test): the C++ decode kernel at SmolLM2-135M decode shapes, one call
per layer, each layer with its own cache as in the engine (so nothing stays in the CPU caches
between calls), against the same kernel built from another git revision (--against, default
main) and optionally the torch reference (--ref).

    python -m pdserve.kernels.cpu.benchmark [--against main] [--threads 2] [--repeats 7] [--ref]

Contexts: a fixed 270 tokens (the old benchmark), and the serving workload's mix (prompts of
32-512 tokens plus up to 256 generated), and one long sequence (the split across threads).
Kernels and cases run interleaved, and the medians are printed with the base/new ratio: other
processes on the machine only ever add time, and within one run they hit both kernels alike.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from pdserve.kernels.cpu import build, paged_decode_attention
from pdserve.kernels.paged_attention import paged_decode_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30
# (name, batch, context lengths or None for the workload's mix)
CASES = [("b64 ctx270", 64, [270] * 64), ("b64 mixed", 64, None), ("b32 mixed", 32, None),
         ("b1 ctx4096", 1, [4096]), ("b2 ctx1500", 2, [1500, 1200])]
CACHE_BYTES = 512 << 20  # the layers' caches together: well past the 32 MiB L3


def workload_lens(batch: int, generator: torch.Generator) -> list[int]:
    prompts = torch.randint(32, 513, (batch,), generator=generator)
    generated = torch.randint(0, 257, (batch,), generator=generator)
    return (prompts + generated).tolist()


def make_case(lens: list[int], dtype: torch.dtype) -> tuple:
    """(query, layers: [(key_cache, value_cache)], tables, seq_lens) with shuffled blocks and
    as many layers (up to NUM_LAYERS) as fit CACHE_BYTES."""
    blocks_per_seq = -(-max(lens) // BLOCK_SIZE)
    num_blocks = len(lens) * blocks_per_seq
    layer_bytes = 2 * num_blocks * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = max(2, min(NUM_LAYERS, CACHE_BYTES // layer_bytes))
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype) for _ in range(layers)]
    tables = torch.randperm(num_blocks).view(len(lens), blocks_per_seq).to(torch.int32)
    query = torch.randn(len(lens), NUM_HEADS, HEAD_DIM).to(dtype)
    return query, [(c[0], c[1]) for c in caches], tables, torch.tensor(lens, dtype=torch.int32)


def load_kernel_from(rev: str):
    """The decode kernel as of git revision `rev`, built under its own name and op namespace
    (pdserve_base) so it loads beside the working tree's."""
    repo = Path(__file__).resolve().parents[2]
    sha = subprocess.run(["git", "rev-parse", "--short=12", rev], cwd=repo, capture_output=True, text=True,
                         check=True).stdout.strip()
    source = subprocess.run(["git", "show", f"{sha}:kernels/cpu/paged_attention.cpp"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    source = source.replace("TORCH_LIBRARY(pdserve,", "TORCH_LIBRARY(pdserve_base,")
    source = source.replace("TORCH_LIBRARY_IMPL(pdserve,", "TORCH_LIBRARY_IMPL(pdserve_base,")
    path = Path(tempfile.gettempdir()) / f"pdserve_base_{sha}" / "paged_attention.cpp"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    with build._ninja_on_path():
        cpp_extension.load(name=f"pdserve_base_{sha}", sources=[str(path)], extra_cflags=build.CFLAGS,
                           extra_ldflags=build.LDFLAGS, is_python_module=False, verbose=False)
    op = torch.ops.pdserve_base.paged_decode_attention

    def kernel(query, key_cache, value_cache, tables, lens, scale):
        return op(torch.empty_like(query), query, key_cache, value_cache, tables, lens, scale, 0, 0.0)
    return kernel


def time_layers(kernel, case: tuple) -> float:
    query, layers, tables, lens = case
    start = time.perf_counter()
    for key_cache, value_cache in layers:
        kernel(query, key_cache, value_cache, tables, lens, 0.125)
    return (time.perf_counter() - start) / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="main", help="git revision of the base kernel ('' for none)")
    parser.add_argument("--threads", default="2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--ref", action="store_true", help="also time the torch reference (slow)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    cases = {name: make_case(lens or workload_lens(batch, generator), dtype) for name, batch, lens in CASES}
    kernels = {"new": paged_decode_attention}
    if args.against:
        kernels["base"] = load_kernel_from(args.against)
    if args.ref:
        kernels["ref"] = paged_decode_attention_ref
    times: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for case_name, case in cases.items():
                for name, kernel in kernels.items():
                    times.setdefault((threads, case_name, name), []).append(time_layers(kernel, case))
    print(f"{args.dtype}, ms per layer call, median of {args.repeats} (min)")
    for threads in map(int, args.threads.split(",")):
        for case_name, case in cases.items():
            row = {name: statistics.median(times[threads, case_name, name]) for name in kernels}
            cells = "  ".join(f"{name} {row[name] * 1e3:7.3f} ({min(times[threads, case_name, name]) * 1e3:7.3f})"
                              for name in kernels)
            ratio = f"  base/new {row['base'] / row['new']:.2f}x" if "base" in row else ""
            kv_gb = 2 * int(case[3].sum()) * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize / 1e9
            print(f"{threads}t {case_name:11s} {cells}{ratio}  new {kv_gb / row['new']:.1f} GB/s")


if __name__ == "__main__":
    main()
