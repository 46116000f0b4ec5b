"""The CPU reference backend: the torch references from kernels/, decodes batched.

Gathering the paged cache dominates CPU decode time, and a batch gathers up to its longest
sequence; so decodes are grouped by context length and each group gathered on its own.
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels.cache_ops import reshape_and_cache_ref
from kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref


_DECODE_GROUP = 16  # sequences per length group


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decodes
        out = torch.empty_like(query)
        if nd:
            self._decode(query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                         scale, out[:nd])
        if nd == meta.num_seqs:
            return out
        loc = meta.query_start_loc[nd:]
        out[nd:] = paged_prefill_attention_ref(query[nd:], key_cache, value_cache, meta.block_tables[nd:],
                                               loc - loc[0], meta.seq_lens[nd:], scale)
        return out

    @staticmethod
    def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, out) -> None:
        if query.shape[0] < 2 * _DECODE_GROUP:
            out[:] = paged_decode_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, scale)
            return
        order = seq_lens.argsort()
        for idx in order.split(_DECODE_GROUP):
            out[idx] = paged_decode_attention_ref(query[idx], key_cache, value_cache, block_tables[idx],
                                                  seq_lens[idx], scale)
