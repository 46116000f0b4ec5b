"""C++ CPU kernels, each beside its torch reference in kernels/ (built on first use, see build.py).

paged_decode_attention: paged_decode_attention_ref without its gather, reading each
sequence's K/V rows in place through its block table.
rms_norm, fused_add_rms_norm, rotary_embedding: the decoder's per-token ops in one call each
(fused_ops.cpp), rounding as engine/model/decoder.py's RMSNorm and rope.py's RotaryEmbedding do.
skinny_linear: F.linear for 0..SKINNY_MAX_ROWS rows of float32, streaming the plain weight
(skinny_linear.cpp): decode batches of a few sequences, where a linear layer is a read of its weight.
"""
from __future__ import annotations

import torch

__all__ = ["paged_decode_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "skinny_linear",
           "SKINNY_MAX_ROWS"]

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


def _load() -> None:
    # imported here, not at the top: `python -m pdserve.kernels.cpu.build` must not find it imported
    from pdserve.kernels.cpu.build import load_library
    load_library()  # cached: builds or loads once per process
