"""Check the Triton attention/KV-cache kernels against their torch references at realistic
shapes, then time them against torch SDPA over a contiguous (pre-gathered) cache.

    python -m bench.gpu_kernels                    # on a CUDA machine
    python -m bench.gpu_kernels --peak-gbps 3350   # a device missing from PEAK_GBPS
    python -m bench.gpu_kernels --device cpu       # interpreter smoke run, tiny shapes, no timing

Exit status: 0 when every check passes and (on a known H100/H200) the decode bandwidth target
is met, 1 otherwise. See docs/kernels.md.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch

# Device name substring -> peak HBM bandwidth in GB/s (vendor figures), most specific first.
PEAK_GBPS = [("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350),
             ("A100-SXM4-80GB", 2039), ("A100 80GB", 1935), ("A100", 1555), ("L40S", 864),
             ("RTX 4090", 1008), ("A10", 600), ("L4", 300)]
TARGET_DEVICES, TARGET_FRACTION, TARGET_BATCH, TARGET_CONTEXT = ("H100", "H200"), 0.70, 64, 4096
BLOCK_SIZE = 16
MEMORY_MARGIN = 1.25  # headroom over the estimated bytes a case allocates


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


MODELS = [ModelShape("smollm2-135m", 9, 3, 64), ModelShape("8b-class", 32, 8, 128)]
# Decode: (batch, context); prefill: (num_seqs, chunk length, cached prefix length).
DECODE_SHAPES = [(1, 128), (1, 32768), (16, 1024), (64, 4096), (256, 1024), (256, 4096), (64, 32768)]
PREFILL_SHAPES = [(1, 2048, 0), (8, 512, 0), (4, 512, 3584), (1, 8192, 0)]
SMALL_DECODE_SHAPES = [(1, 17), (3, 1100)]  # 1100: three split-KV partitions
SMALL_PREFILL_SHAPES = [(2, 33, 0), (2, 20, 47)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu runs the kernels in the Triton interpreter (implies --small, no timing)")
    parser.add_argument("--small", action="store_true", help="tiny shapes only: a quick smoke run")
    parser.add_argument("--peak-gbps", type=float, help="peak HBM bandwidth, overriding the device table")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    args.small = args.small or args.device == "cpu"
    return args


def peak_gbps(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    return next((gbps for key, gbps in PEAK_GBPS if key in device_name), None)


def fits(num_bytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return num_bytes * MEMORY_MARGIN < free


def kv_bytes(shape: ModelShape, num_tokens: int, dtype: torch.dtype) -> int:
    return 2 * num_tokens * shape.num_kv_heads * shape.head_dim * dtype.itemsize


@dataclass
class PagedCache:
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def make_paged_cache(shape: ModelShape, seq_lens: list[int], dtype: torch.dtype,
                     device: torch.device) -> PagedCache:
    """Random K/V in shuffled blocks, as a long-running server's fragmented pool looks."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    ids = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    start = 0
    for row, n in enumerate(blocks_per_seq):
        tables[row, :n] = ids[start:start + n]
        start += n
    return PagedCache(torch.randn(cache_shape, device=device, dtype=dtype),
                      torch.randn(cache_shape, device=device, dtype=dtype), tables,
                      torch.tensor(seq_lens, dtype=torch.int32, device=device))


def gathered(cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, kv_heads, max_len, dim] contiguous K/V: the layout SDPA wants (baseline only)."""
    table = cache.block_tables.long()
    keys = cache.key_cache[table].flatten(1, 2).transpose(1, 2).contiguous()
    return keys, cache.value_cache[table].flatten(1, 2).transpose(1, 2).contiguous()


def report_check(name: str, out: torch.Tensor, ref: torch.Tensor) -> bool:
    ok = torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    err = (out.float() - ref.float()).abs().max().item()
    print(f"  check {name:<52} max|err| {err:.2e}  {'ok' if ok else 'MISMATCH'}")
    return ok


def check_decode(pa, shape: ModelShape, batch: int, context: int, dtype, device) -> bool:
    # Ragged lengths up to `context`, with the longest exactly `context`.
    lens = torch.randint(1, context + 1, (batch,)).tolist()
    lens[0] = context
    cache = make_paged_cache(shape, lens, dtype, device)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens,
            shape.head_dim ** -0.5)
    return report_check(f"decode {shape.name} batch {batch} ctx <={context}",
                        pa.paged_decode_attention(*args), pa.paged_decode_attention_ref(*args))


def prefill_inputs(shape: ModelShape, num_seqs: int, chunk: int, prefix: int, dtype, device):
    cache = make_paged_cache(shape, [prefix + chunk] * num_seqs, dtype, device)
    query = torch.randn(num_seqs * chunk, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    query_start_loc = torch.arange(0, num_seqs * chunk + 1, chunk, dtype=torch.int32, device=device)
    return cache, (query, cache.key_cache, cache.value_cache, cache.block_tables, query_start_loc,
                   cache.seq_lens, shape.head_dim ** -0.5)


def check_prefill(pa, shape: ModelShape, num_seqs: int, chunk: int, prefix: int, dtype, device) -> bool:
    _, args = prefill_inputs(shape, num_seqs, chunk, prefix, dtype, device)
    return report_check(f"prefill {shape.name} {num_seqs} x {chunk} after {prefix}",
                        pa.paged_prefill_attention(*args), pa.paged_prefill_attention_ref(*args))


def check_cache_write(co, shape: ModelShape, num_tokens: int, dtype, device) -> bool:
    cache = make_paged_cache(shape, [num_tokens + BLOCK_SIZE], dtype, device)
    key, value = torch.randn(2, num_tokens, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    slots = torch.randperm(num_tokens + BLOCK_SIZE, device=device)[:num_tokens]
    slots[::7] = -1
    ref_key, ref_value = cache.key_cache.clone(), cache.value_cache.clone()
    co.reshape_and_cache(key, value, cache.key_cache, cache.value_cache, slots)
    co.reshape_and_cache_ref(key, value, ref_key, ref_value, slots)
    return report_check(f"reshape_and_cache {shape.name} {num_tokens} tokens",
                        torch.stack([cache.key_cache, cache.value_cache]), torch.stack([ref_key, ref_value]))


def run_checks(pa, co, args, dtype, device) -> bool:
    decode_shapes = SMALL_DECODE_SHAPES if args.small else [(1, 32768), (64, 4097), (256, 1000)]
    prefill_shapes = SMALL_PREFILL_SHAPES if args.small else [(1, 2048, 0), (4, 300, 1777)]
    results = []
    for shape in MODELS:
        results.append(check_cache_write(co, shape, 37 if args.small else 4096, dtype, device))
        results += [check_decode(pa, shape, b, c, dtype, device) for b, c in decode_shapes]
        results += [check_prefill(pa, shape, n, q, p, dtype, device) for n, q, p in prefill_shapes]
    return all(results)


def time_ms(fn) -> float:
    import triton.testing  # not at the top: TRITON_INTERPRET must be set before triton loads
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def sdpa_ms(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, **kwargs) -> float | None:
    """SDPA time restricted to its fused kernels (the math fallback would materialize the
    score matrix: not a baseline worth beating, and an OOM at long context); None if none applies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):
        try:
            return time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, enable_gqa=True, **kwargs))
        except RuntimeError as error:  # "No available kernel": no fused kernel takes these inputs
            print(f"    sdpa: {str(error).splitlines()[0]}")
            return None


def format_ms(ms: float | None) -> str:
    return "     n/a" if ms is None else f"{ms:8.3f}"


def bench_decode(pa, shape: ModelShape, batch: int, context: int, dtype, device, peak) -> float | None:
    """Prints kernel vs SDPA time and achieved bandwidth; returns the fraction of peak."""
    cache_bytes = kv_bytes(shape, batch * context, dtype)
    if not fits(2 * cache_bytes, device):  # the paged cache plus SDPA's gathered copy
        print(f"  decode {shape.name} batch {batch:>3} ctx {context:>5}: "
              f"skipped, needs {2 * cache_bytes / 1e9:.1f} GB")
        return None
    cache = make_paged_cache(shape, [context] * batch, dtype, device)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, device=device, dtype=dtype)
    scale = shape.head_dim ** -0.5
    kernel_ms = time_ms(lambda: pa.paged_decode_attention(
        query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, scale,
        max_seq_len=context))
    keys, values = gathered(cache)
    del cache
    baseline_ms = sdpa_ms(query.unsqueeze(2), keys, values, scale=scale)
    gbps = (cache_bytes + 2 * query.numel() * dtype.itemsize) / kernel_ms / 1e6
    fraction = gbps / peak if peak else None
    of_peak = f" ({100 * fraction:.0f}% of peak)" if fraction else ""
    print(f"  decode {shape.name} batch {batch:>3} ctx {context:>5}: triton {kernel_ms:8.3f} ms "
          f"{gbps:7.0f} GB/s{of_peak}   sdpa(gathered) {format_ms(baseline_ms)} ms")
    return fraction


def bench_prefill(pa, shape: ModelShape, num_seqs: int, chunk: int, prefix: int, dtype, device) -> None:
    name = f"prefill {shape.name} {num_seqs} x {chunk:>4} after {prefix:>4}"
    if not fits(2 * kv_bytes(shape, num_seqs * (prefix + chunk), dtype), device):
        print(f"  {name}: skipped, does not fit")
        return
    cache, args = prefill_inputs(shape, num_seqs, chunk, prefix, dtype, device)
    kernel_ms = time_ms(lambda: pa.paged_prefill_attention(*args, max_query_len=chunk))
    keys, values = gathered(cache)
    query = args[0].view(num_seqs, chunk, shape.num_heads, shape.head_dim).transpose(1, 2)
    mask = None
    if prefix:  # the chunk sees the whole prefix, and itself causally
        mask = torch.ones(chunk, prefix + chunk, dtype=torch.bool, device=device).tril(prefix)
    baseline_ms = sdpa_ms(query, keys, values, attn_mask=mask, is_causal=mask is None, scale=args[-1])
    # Visible (query, key) pairs: each query token sees the prefix and the chunk up to itself.
    pairs = num_seqs * (chunk * prefix + chunk * (chunk + 1) // 2)
    flops = 4 * pairs * shape.num_heads * shape.head_dim
    baseline = "" if baseline_ms is None else f" {flops / baseline_ms / 1e9:6.1f} TFLOP/s"
    print(f"  {name}: triton {kernel_ms:8.3f} ms {flops / kernel_ms / 1e9:6.1f} TFLOP/s   "
          f"sdpa(gathered) {format_ms(baseline_ms)} ms{baseline}")


def run_timings(pa, args, dtype, device) -> bool:
    """Returns False only when the decode target applies to this device and is missed."""
    name = torch.cuda.get_device_name(device)
    peak = peak_gbps(name, args.peak_gbps)
    print(f"\ntiming on {name}, peak HBM {peak or 'unknown (pass --peak-gbps)'} GB/s")
    decode_shapes = SMALL_DECODE_SHAPES if args.small else DECODE_SHAPES
    prefill_shapes = SMALL_PREFILL_SHAPES if args.small else PREFILL_SHAPES
    met = True
    for shape in MODELS:
        for batch, context in decode_shapes:
            fraction = bench_decode(pa, shape, batch, context, dtype, device, peak)
            if (batch, context) == (TARGET_BATCH, TARGET_CONTEXT) and fraction is not None:
                met &= report_target(shape, name, fraction)
            torch.cuda.empty_cache()
        for num_seqs, chunk, prefix in prefill_shapes:
            bench_prefill(pa, shape, num_seqs, chunk, prefix, dtype, device)
            torch.cuda.empty_cache()
    return met


def report_target(shape: ModelShape, device_name: str, fraction: float) -> bool:
    verdict = "PASS" if fraction >= TARGET_FRACTION else "FAIL"
    applies = any(key in device_name for key in TARGET_DEVICES)
    note = "" if applies else " (target defined for H100/H200 only; not counted)"
    print(f"  TARGET decode {shape.name} batch {TARGET_BATCH} x ctx {TARGET_CONTEXT}: "
          f"{100 * fraction:.0f}% of peak HBM (>= {100 * TARGET_FRACTION:.0f}%) {verdict}{note}")
    return verdict == "PASS" or not applies


def main() -> int:
    args = parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported
    elif not torch.cuda.is_available():
        sys.exit("bench/gpu_kernels.py: CUDA is not available on this machine "
                 "(for an interpreter smoke run of the checks use --device cpu)")
    from pdserve.kernels import cache_ops, paged_attention
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"correctness vs torch references ({args.dtype}, block size {BLOCK_SIZE})")
    ok = run_checks(paged_attention, cache_ops, args, dtype, device)
    met = run_timings(paged_attention, args, dtype, device) if device.type == "cuda" else True
    if device.type != "cuda":
        print("timing skipped: it needs CUDA")
    print(f"\nchecks {'passed' if ok else 'FAILED'}")
    return 0 if ok and met else 1


if __name__ == "__main__":
    sys.exit(main())
