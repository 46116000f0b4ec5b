"""The default CPU backend: decodes through the C++ kernel in kernels/cpu, which reads each
sequence's K/V rows in place through its block table, up to its own length. So unlike the
torch backend there is no gather to copy and no length grouping to bound it: the whole
decode batch is one call. Cache writes and prefills are the torch backend's references.
"""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels.cache_ops import reshape_and_cache_ref
from kernels.cpu import paged_decode_attention
from kernels.cpu.build import load_library
from kernels.paged_attention import paged_prefill_attention_ref


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self):
        load_library()  # build or load now: a missing compiler fails at engine start, not mid-step

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decodes
        out = torch.empty_like(query)
        if nd:
            paged_decode_attention(query[:nd], key_cache, value_cache, meta.block_tables[:nd],
                                   meta.seq_lens[:nd], scale, out=out[:nd])
        if nd == meta.num_seqs:
            return out
        loc = meta.query_start_loc[nd:]
        out[nd:] = paged_prefill_attention_ref(query[nd:], key_cache, value_cache, meta.block_tables[nd:],
                                               loc - loc[0], meta.seq_lens[nd:], scale)
        return out
