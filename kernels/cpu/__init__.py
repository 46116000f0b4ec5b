"""C++ CPU kernels, each beside its torch reference in kernels/ (built on first use, see build.py).

paged_decode_attention: paged_decode_attention_ref without its gather, reading each
sequence's K/V rows in place through its block table.
rms_norm, fused_add_rms_norm, rotary_embedding: the decoder's per-token ops in one call each
(fused_ops.cpp), rounding as engine/model/decoder.py's RMSNorm and rope.py's RotaryEmbedding do.
skinny_linear: F.linear for 0..SKINNY_MAX_ROWS rows of float32, streaming the plain weight
(skinny_linear.cpp): decode batches of a few sequences, where a linear layer is a read of its weight.
skinny_linear_fp8: the same over an fp8 weight's bytes and scales (engine/model/fp8_linear.py),
dequantized in registers; dequantize_fp8: that weight as float32, for larger batches' GEMM.
skinny_linear_gguf, dequantize_gguf: the same pair over a weight kept in GGUF's Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K or Q6_K blocks (engine/model/gguf_linear.py), equal to gguf-py's dequantized weight bit for bit.
"""
from __future__ import annotations

import torch

__all__ = ["paged_decode_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "skinny_linear",
           "skinny_linear_fp8", "dequantize_fp8", "skinny_linear_gguf", "dequantize_gguf", "SKINNY_MAX_ROWS"]

SKINNY_MAX_ROWS = 4  # skinny_linear.cpp: kMaxRows


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Same arguments and result as `paged_decode_attention_ref`; query and the caches share one
    dtype (float32, bfloat16 or float16), block_tables and seq_lens are int32. out receives the result."""
    _load()
    if window is not None and window < 1 or softcap is not None and softcap <= 0:
        raise ValueError(f"window: expected None or >= 1, softcap: None or > 0; got {window}, {softcap}")
    out = torch.empty_like(query) if out is None else out
    # the op's 0 / 0.0 mean no window / no soft-cap
    return torch.ops.pdserve.paged_decode_attention(out, query, key_cache, value_cache, block_tables,
                                                    seq_lens, scale, window or 0, softcap or 0.0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm(x) of rows [n, d] (rows contiguous); offset: Gemma's (1 + w) scaling."""
    _load()
    return torch.ops.pdserve.rms_norm(torch.empty_like(x, memory_format=torch.contiguous_format), x, weight, eps, offset)


def fused_add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + h), x + h), the sum rounded to the dtype first as `x + h` would be."""
    _load()
    total = torch.empty_like(x, memory_format=torch.contiguous_format)
    normed = torch.ops.pdserve.fused_add_rms_norm(torch.empty_like(total), total, x, h, weight, eps, offset)
    return normed, total


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                     sin_table: torch.Tensor) -> None:
    """Rotates q [T, heads, d] and k [T, kv_heads, d] in place (rotate_half style, the first
    cos_table.shape[1] dims of each head)."""
    _load()
    torch.ops.pdserve.rotary_embedding(q, k, positions, cos_table, sin_table)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for float32 x of 0..SKINNY_MAX_ROWS rows and a contiguous weight."""
    _load()
    return torch.ops.pdserve.skinny_linear(x, weight, bias)


def skinny_linear_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_columns: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for float32 x of 0..SKINNY_MAX_ROWS rows, where W is the fp8 weight
    whose bytes are `weight` (uint8 [out, in]) times `scale` (float32 [out, ceil(in / block_columns)],
    block_columns a multiple of 16 or the whole row), as Fp8Linear.dequantized gives it."""
    _load()
    return torch.ops.pdserve.skinny_linear_fp8(x, weight, scale, block_columns, bias)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_columns: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight `weight` (fp8 bytes, uint8 [out, in]) times `scale` stands for, as
    skinny_linear_fp8 reads it; written into `out` when given."""
    _load()
    out = torch.empty(weight.shape, dtype=torch.float32) if out is None else out
    torch.ops.pdserve.dequantize_fp8(out, weight, scale, block_columns)
    return out


def skinny_linear_gguf(x: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for float32 x of 0..SKINNY_MAX_ROWS rows, where W is the weight
    whose GGUF blocks of `ggml_type` (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12,
    Q6_K 14) are `weight`'s
    rows (uint8 [out, in / block columns x block bytes])."""
    _load()
    return torch.ops.pdserve.skinny_linear_gguf(x, weight, ggml_type, bias)


def dequantize_gguf(weight: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight GGUF blocks stand for (as gguf.quants.dequantize gives it), written
    into `out` when given."""
    _load()
    if out is None:
        out = torch.empty(weight.shape[0], gguf_columns(weight.shape[1], ggml_type), dtype=torch.float32)
    torch.ops.pdserve.dequantize_gguf(out, weight, ggml_type)
    return out


# ggml type id -> (columns, bytes) of one block (gguf.constants.GGML_QUANT_SIZES)
GGUF_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 14: (256, 210)}


def gguf_columns(row_bytes: int, ggml_type: int) -> int:
    columns, block_bytes = GGUF_BLOCKS[ggml_type]
    return row_bytes // block_bytes * columns


def _load() -> None:
    # imported here, not at the top: `python -m pdserve.kernels.cpu.build` must not find it imported
    from pdserve.kernels.cpu.build import load_library
    load_library()  # cached: builds or loads once per process
