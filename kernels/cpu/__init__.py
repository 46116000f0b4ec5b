"""C++ CPU kernels, each beside its torch reference in kernels/ (built on first use, see build.py).

paged_decode_attention: paged_decode_attention_ref without its gather, reading each
sequence's K/V rows in place through its block table.
"""
from __future__ import annotations

import torch

__all__ = ["paged_decode_attention"]


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Same arguments and result as `paged_decode_attention_ref`; query and the caches share one
    dtype (float32, bfloat16 or float16), block_tables and seq_lens are int32. out receives the result."""
    # imported here, not at the top: `python -m kernels.cpu.build` must not find it imported
    from kernels.cpu.build import load_library
    load_library()
    if window is not None and window < 1 or softcap is not None and softcap <= 0:
        raise ValueError(f"window: expected None or >= 1, softcap: None or > 0; got {window}, {softcap}")
    out = torch.empty_like(query) if out is None else out
    # the op's 0 / 0.0 mean no window / no soft-cap
    return torch.ops.pdserve.paged_decode_attention(out, query, key_cache, value_cache, block_tables,
                                                    seq_lens, scale, window or 0, softcap or 0.0)
