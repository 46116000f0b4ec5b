"""One step's packed model inputs: what the model runner builds and every forward reads
(an eager forward, a captured decode graph, the ranks of a parallel engine)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata


@dataclass
class StepInputs:
    """One micro-batch's model inputs: what every rank needs to run its layers."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def shape_fields(self) -> list[int]:
        m = self.meta
        return [self.num_tokens, m.num_seqs, m.block_tables.shape[1], self.logits_indices.shape[0],
                m.num_decodes, m.max_query_len, m.max_seq_len]

    def pack(self) -> torch.Tensor:
        m = self.meta
        parts = [self.input_ids, self.positions, m.query_start_loc, m.seq_lens, m.block_tables.flatten(),
                 m.slot_mapping, self.logits_indices]
        return torch.cat([p.to(device="cpu", dtype=torch.int64) for p in parts])


@dataclass
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]
    # per sampling request, the drafts it is scored on (its logits rows: one more than drafts)
    drafts: list[list[int]]

    @classmethod
    def joined(cls, batches: list[StepBatch]) -> StepBatch:
        """Micro-batches as one for sampling: their sampled requests (and logits rows) in order."""
        first = batches[0]
        return cls(first.input_ids, first.positions, first.meta, first.logits_indices,
                   [r for b in batches for r in b.sampling_req_ids], [d for b in batches for d in b.drafts])

    @property
    def inputs(self) -> StepInputs:
        return StepInputs(self.input_ids, self.positions, self.meta, self.logits_indices)

    @property
    def row_keys(self) -> list[tuple[str, int]]:
        """Each logits row as (request, j): the request's j-th scored row (after j drafts)."""
        return [(req_id, j) for req_id, d in zip(self.sampling_req_ids, self.drafts) for j in range(len(d) + 1)]
