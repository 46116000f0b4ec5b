"""One step's packed model inputs: what the model runner builds and every forward reads
(an eager forward, a captured decode graph, the ranks of a parallel engine)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.attention.backend import AttentionMetadata


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


@dataclass(frozen=True)
class PromptRows:
    """Logits rows for a request's prompt logprobs: those of its positions start .. start +
    num - 1, each scoring the prompt token after it."""
    req_id: str
    start: int
    num: int


@dataclass
class StepBatch:
    """A micro-batch's logits rows: its sampling rows (row_keys' order), then its prompt rows.

        logits_indices: [ sampling rows: last token (+ drafts) per request | prompt rows ]
        prompt rows, one request's chunk:  positions  start ........ start+num-1
                                           score      start+1 ...... start+num   (prompt tokens)
    """
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_req_ids: list[str]
    # per sampling request, the drafts it is scored on (its logits rows: one more than drafts)
    drafts: list[list[int]]
    prompt_rows: list[PromptRows] = field(default_factory=list)
    # per micro-batch (sampling rows, prompt rows), as the forward returns them; None: this one's
    parts: list[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        if self.parts is None:
            num_prompt = sum(r.num for r in self.prompt_rows)
            self.parts = [(self.logits_indices.shape[0] - num_prompt, num_prompt)]

    @classmethod
    def joined(cls, batches: list[StepBatch]) -> StepBatch:
        """Micro-batches as one for sampling: their sampled requests (and logits rows) in order."""
        first = batches[0]
        return cls(first.input_ids, first.positions, first.meta, first.logits_indices,
                   [r for b in batches for r in b.sampling_req_ids], [d for b in batches for d in b.drafts],
                   [r for b in batches for r in b.prompt_rows], [p for b in batches for p in b.parts])

    def split_logits(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's rows as (sampling rows, prompt rows); None: no prompt rows."""
        if not self.prompt_rows:
            return logits, None
        sampling, prompt, at = [], [], 0
        for num_sampling, num_prompt in self.parts:
            sampling.append(logits[at:at + num_sampling])
            prompt.append(logits[at + num_sampling:at + num_sampling + num_prompt])
            at += num_sampling + num_prompt
        return torch.cat(sampling), torch.cat(prompt)

    @property
    def inputs(self) -> StepInputs:
        return StepInputs(self.input_ids, self.positions, self.meta, self.logits_indices)

    @property
    def row_keys(self) -> list[tuple[str, int]]:
        """Each logits row as (request, j): the request's j-th scored row (after j drafts)."""
        return [(req_id, j) for req_id, d in zip(self.sampling_req_ids, self.drafts) for j in range(len(d) + 1)]
