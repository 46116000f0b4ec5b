"""The CPU reference backend: the torch references from kernels/, decodes batched.

Gathering the paged cache dominates CPU decode time, and a batch gathers every sequence
up to its longest context. Serving mixes short and long contexts (a 2k-token prompt
decoding beside 64-token chats would make each chat gather 2k tokens of padding), so
decodes are grouped by context length and each group gathered on its own. A windowed
layer gathers at most the window per sequence, so it groups by min(length, window).
"""
from __future__ import annotations

import torch

from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.kernels.cache_ops import reshape_and_cache_ref
from pdserve.kernels.paged_attention import paged_decode_attention_ref, paged_prefill_attention_ref

# A group's longest context is at most twice its shortest, or this many tokens more:
# padding stays below half of what is gathered, and the number of groups stays small.
_GROUP_SLACK_TOKENS = 256
_GROUP_MAX_SEQS = 16  # big batches: sorted neighbours pad even less


def length_groups(seq_lens: list[int]) -> list[list[int]]:
    """Decode indices grouped by context length, shortest first:

        lengths 70 65 2050 90 2060  ->  [65 70 90] [2050 2060]
    """
    groups: list[list[int]] = []
    shortest = 0
    for i in sorted(range(len(seq_lens)), key=seq_lens.__getitem__):
        if (groups and len(groups[-1]) < _GROUP_MAX_SEQS
                and seq_lens[i] <= max(2 * shortest, shortest + _GROUP_SLACK_TOKENS)):
            groups[-1].append(i)
        else:
            groups.append([i])
            shortest = seq_lens[i]
    return groups


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self):
        # every layer of a step sees the same metadata: group its decodes once per step (and
        # window: a model's layers may alternate windowed and full attention)
        self._groups_meta: AttentionMetadata | None = None
        self._groups: dict[int | None, list[torch.Tensor] | None] = {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        reshape_and_cache_ref(key, value, key_cache, value_cache, meta.slot_mapping)
        nd = meta.num_decodes
        out = torch.empty_like(query)
        if nd:
            self._decode_batch(query[:nd], key_cache, value_cache, meta, scale, out[:nd], window, softcap)
        if nd == meta.num_seqs:
            return out
        loc = meta.query_start_loc[nd:]
        out[nd:] = paged_prefill_attention_ref(query[nd:], key_cache, value_cache, meta.block_tables[nd:],
                                               loc - loc[0], meta.seq_lens[nd:], scale, window=window,
                                               softcap=softcap)
        return out

    def _decode_batch(self, query, key_cache, value_cache, meta: AttentionMetadata, scale: float,
                      out: torch.Tensor, window: int | None, softcap: float | None) -> None:
        """Attention of the step's decodes (the first meta.num_decodes sequences) into `out`."""
        nd = meta.num_decodes
        groups = self._decode_groups(meta, window)
        if groups is None:
            out[:] = paged_decode_attention_ref(query, key_cache, value_cache, meta.block_tables[:nd],
                                                meta.seq_lens[:nd], scale, window=window, softcap=softcap)
            return
        for idx in groups:
            out[idx] = paged_decode_attention_ref(query[idx], key_cache, value_cache, meta.block_tables[idx],
                                                  meta.seq_lens[idx], scale, window=window, softcap=softcap)

    def _decode_groups(self, meta: AttentionMetadata, window: int | None) -> list[torch.Tensor] | None:
        """The step's decode index groups by gathered length; None when one gather serves them all."""
        if meta is not self._groups_meta:
            self._groups, self._groups_meta = {}, meta
        if window not in self._groups:
            lens = meta.seq_lens[:meta.num_decodes].tolist()
            groups = length_groups(lens if window is None else [min(n, window) for n in lens])
            self._groups[window] = None if len(groups) == 1 else [
                torch.tensor(g, device=meta.seq_lens.device) for g in groups]
        return self._groups[window]
