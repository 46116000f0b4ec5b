"""The kernels compile for real GPUs, checked without one.

The interpreter runs kernels as Python, so it cannot catch code that fails to compile, nor
codegen that silently loses tensor cores or vectorized loads. Here each kernel is lowered to
PTX and assembled (Triton ships ptxas) for sm_80 and sm_90 with the arguments specialized as
the JIT would for real shapes. The compile runs in a subprocess without TRITON_INTERPRET,
which conftest.py sets for this process and which Triton reads at import.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# (num_heads, num_kv_heads, head_dim): SmolLM2-135M and an 8B-class model.
MODEL_SHAPES = [(9, 3, 64), (32, 8, 128)]
BLOCK_SIZE = 16
TARGETS = {80: "mma.sync", 90: "wgmma.mma_async"}  # arch -> prefill's tensor-core instruction


def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def compile_ptx(fn, values: dict, constexprs: dict, arch: int, num_warps: int = 4) -> str:
    """Specialize like the JIT does: pointers and ints divisible by 16 get the divisibility
    hint, ints equal to 1 become constants; then compile and return the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for index, name in enumerate(fn.arg_names):
        value = values.get(name)
        if name in constexprs or value == 1:
            signature[name] = "constexpr"
            constexprs.setdefault(name, value)
        elif isinstance(value, str):
            signature[name], attrs[(index,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return kernel.asm["ptx"]


def cache_strides(num_kv_heads: int, head_dim: int) -> dict:
    return dict(stride_cb=BLOCK_SIZE * num_kv_heads * head_dim, stride_cs=num_kv_heads * head_dim,
                stride_ch=head_dim, block_size=BLOCK_SIZE)


def attention_values(num_heads: int, num_kv_heads: int, head_dim: int, dtype: str) -> dict:
    """Pointers and strides as the backend passes them: q/k/v are slices of a fused QKV."""
    qkv_stride = (num_heads + 2 * num_kv_heads) * head_dim
    return dict(out_ptr=dtype, q_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype, block_tables_ptr="*i32",
                seq_lens_ptr="*i32", query_start_loc_ptr="*i32", part_acc_ptr="*fp32", part_max_ptr="*fp32",
                part_sum_ptr="*fp32", scale_log2=0.18, window=4096, softcap_scale=0.0025, softcap_log2=72.1,
                stride_qs=qkv_stride, stride_qt=qkv_stride,
                stride_qh=head_dim, stride_os=num_heads * head_dim, stride_ot=num_heads * head_dim,
                stride_oh=head_dim, stride_bt=257, num_heads=num_heads, max_partitions=8,
                **cache_strides(num_kv_heads, head_dim))


def check_attention(pa, shape: tuple[int, int, int], arch: int, dtype: str = "*bf16") -> None:
    import triton
    num_heads, num_kv_heads, head_dim = shape
    group = num_heads // num_kv_heads
    values = attention_values(num_heads, num_kv_heads, head_dim, dtype)
    fp32_dot = dtype == "*fp32"  # exact fp32 products: FMA, no tensor cores
    common = dict(GROUP=group, HEAD_DIM=head_dim, DIM_PAD=head_dim, TILE_N=pa.TILE_N, FP32_DOT=fp32_dot)
    # (HAS_WINDOW, SOFTCAP): the plain kernels and Gemma 2's local layers (both on)
    for variant in (dict(HAS_WINDOW=False, SOFTCAP=False), dict(HAS_WINDOW=True, SOFTCAP=True)):
        what = f"sm_{arch} {shape} {dtype} {variant}"
        for single in (True, False):
            ptx = compile_ptx(pa._decode_partition_kernel, values, dict(
                common, GROUP_PAD=16, PARTITION_SIZE=pa.PARTITION_SIZE, SINGLE_PARTITION=single, **variant), arch)
            assert_codegen(ptx, None if fp32_dot else "mma.sync", f"decode {what}")
        block_m = max(pa.BLOCK_M, triton.next_power_of_2(group))
        constexprs = dict(common, BLOCK_M=block_m, BLOCK_Q=block_m // group, **variant)
        ptx = compile_ptx(pa._prefill_kernel, values, constexprs, arch)
        assert_codegen(ptx, None if fp32_dot else TARGETS[arch], f"prefill {what}")
        ptx = compile_ptx(pa._decode_reduce_kernel, values, dict(
            PARTS_PAD=8, HEAD_DIM=head_dim, DIM_PAD=head_dim, PARTITION_SIZE=pa.PARTITION_SIZE,
            HAS_WINDOW=variant["HAS_WINDOW"]), arch)
        assert_codegen(ptx, None, f"decode reduce {what}")


def check_cache_write(co, shape: tuple[int, int, int], arch: int) -> None:
    import triton
    num_heads, num_kv_heads, head_dim = shape
    qkv_stride = (num_heads + 2 * num_kv_heads) * head_dim
    values = dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*bf16", value_cache_ptr="*bf16",
                  slot_mapping_ptr="*i64", stride_kt=qkv_stride, stride_kh=head_dim, stride_vt=qkv_stride,
                  stride_vh=head_dim, num_kv_heads=num_kv_heads, **cache_strides(num_kv_heads, head_dim))
    heads_pad = triton.next_power_of_2(num_kv_heads)
    ptx = compile_ptx(co._reshape_and_cache_kernel, values, dict(HEADS_PAD=heads_pad, HEAD_DIM=head_dim,
                      DIM_PAD=head_dim), arch, num_warps=co._num_warps(heads_pad * head_dim))
    assert_codegen(ptx, None, f"reshape_and_cache sm_{arch} {shape}")


def assert_codegen(ptx: str, mma: str | None, what: str) -> None:
    """16-byte global loads (direct or async copies), and the expected tensor-core instruction."""
    wide_loads = re.search(r"ld\.global(\.\w+)*\.v4\.b32|cp\.async\.cg\.shared\.global", ptx)
    assert wide_loads, f"{what}: no 16-byte global loads"
    assert mma is None or mma in ptx, f"{what}: no {mma}"


def main() -> None:
    from pdserve.kernels import cache_ops, paged_attention
    for arch in TARGETS:
        for shape in MODEL_SHAPES:
            check_attention(paged_attention, shape, arch)
            check_cache_write(cache_ops, shape, arch)
    check_attention(paged_attention, MODEL_SHAPES[1], 90, dtype="*fp32")  # exact fp32 dot path
    print("all kernels compiled")


if __name__ == "__main__":
    main()
