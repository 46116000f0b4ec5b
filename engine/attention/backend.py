"""The attention backend contract: write this step's K/V into the paged cache, then attend.

The model runner packs one flat batch per step, decodes first:

    tokens:  [d0][d1][d2][p0 p0 p0 p0 p0][p1 p1 p1]
              decodes     prefill chunks (each a slice of query_start_loc)

A backend sees q/k/v for all tokens and one AttentionMetadata; how it splits the work
(batched decode, per-sequence prefill, one fused launch) is its own business.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_decodes: int              # the first num_decodes sequences have exactly one query token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, token offsets of each sequence
    seq_lens: torch.Tensor        # [num_seqs] int32, context length including this step
    block_tables: torch.Tensor    # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor    # [num_tokens] int64, cache slot of each token
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(ABC):
    """One instance per engine; stateless across steps."""

    name: str = ""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """query: [T, num_heads, d]; key/value: [T, num_kv_heads, d];
        kv_cache: [2, num_blocks, block_size, num_kv_heads, d] for this layer.
        Stores key/value at meta.slot_mapping, returns attention output [T, num_heads, d].

        This layer's variant (None: off), as transformers defines them:
            window W: the query at position p sees the keys at p - W < j <= p (W keys, its own
                included; sliding_window). Keys before the window need not be read.
            softcap:  scores = softcap * tanh(scores / softcap), after the scale and before the
                mask and softmax (attn_logit_softcapping).
        The cache still holds every position: a window only narrows what is attended."""

