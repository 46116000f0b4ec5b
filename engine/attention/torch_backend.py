"""The CPU reference backend: the torch references from kernels/, decodes batched."""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels.cache_ops import reshape_and_cache_ref
from kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return paged_decode_attention_ref(query, key_cache, value_cache, meta.block_tables,
                                              meta.seq_lens, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = paged_decode_attention_ref(query[:nd], key_cache, value_cache,
                                                  meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        loc = meta.query_start_loc[nd:]
        out[nd:] = paged_prefill_attention_ref(query[nd:], key_cache, value_cache, meta.block_tables[nd:],
                                               loc - loc[0], meta.seq_lens[nd:], scale)
        return out
