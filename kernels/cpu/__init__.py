"""C++ CPU kernels, each beside its torch reference in kernels/ (built on first use, see build.py).

paged_decode_attention: paged_decode_attention_ref without its gather, reading each
sequence's K/V rows in place through its block table.
"""
from __future__ import annotations

import torch

__all__ = ["paged_decode_attention"]


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Same arguments and result as `paged_decode_attention_ref`; query and the caches share one
    dtype (float32, bfloat16 or float16), block_tables and seq_lens are int32. out receives the result."""
    # imported here, not at the top: `python -m kernels.cpu.build` must not find it imported
    from kernels.cpu.build import load_library
    load_library()
    out = torch.empty_like(query) if out is None else out
    return torch.ops.pdserve.paged_decode_attention(out, query, key_cache, value_cache, block_tables,
                                                    seq_lens, scale)
