"""The GPU backend: Triton kernels from kernels/ (on CPU, in the Triton interpreter).

Same split as the torch backend, but without copies: each kernel writes its rows of the
output in place, and the host-side maxima come from the metadata (no device sync).

    tokens:  [d0][d1][d2][p0 p0 p0 p0 p0][p1 p1 p1]
              decode kernel  prefill kernel (one launch, ragged)
"""
from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.kernels.cache_ops import reshape_and_cache
from pdserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(query[:nd], key_cache, value_cache, meta.block_tables[:nd],
                                   meta.seq_lens[:nd], scale, max_seq_len=meta.max_seq_len, out=out[:nd],
                                   window=window, softcap=softcap)
        if nd < meta.num_seqs:
            # Decodes hold one token each, so the prefill chunks start at token nd.
            paged_prefill_attention(query[nd:], key_cache, value_cache, meta.block_tables[nd:],
                                    meta.query_start_loc[nd:] - nd, meta.seq_lens[nd:], scale,
                                    max_query_len=meta.max_query_len, out=out[nd:], window=window,
                                    softcap=softcap)
        return out
