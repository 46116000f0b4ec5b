"""Executes one scheduled step: keeps per-request token and block state, packs the flat
batch, runs the model once (eagerly, or replaying a captured decode graph) and samples."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.model.decoder import DecoderForCausalLM
from engine.model.packed_linear import can_prepack
from engine.sample.sampler import sample
from engine.spec_decode.rejection import verify
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import CudaGraph, DecodeGraphs, Graph, NoDecodeGraphs, sizes_to_capture
from engine.structured.grammar import apply_grammar_bitmask
from engine.worker.step_batch import StepBatch

if TYPE_CHECKING:
    from engine.worker.step_batch import StepInputs


class Forwarder(Protocol):
    """What the runner needs of the engine's executor (engine/executor/base.py), which
    sits above it: the forward and the KV copies, on however many ranks."""
    num_microbatches: int

    def forward(self, batches: list[StepInputs]) -> torch.Tensor: ...
    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None: ...
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor: ...


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int = 0


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 backend: AttentionBackend, device: torch.device, seed: int = 0, *, executor: Forwarder):
        """`executor` runs every eager forward, on one rank or t x p (`model` and
        `kv_caches` are then rank 0's parts); a captured decode graph runs `model` here."""
        self.model = model
        self.executor = executor
        if can_prepack(device, next(model.parameters()).dtype):
            model.prepack()
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.decode_graphs: DecodeGraphs | NoDecodeGraphs = NoDecodeGraphs()  # eager only until capture_decode_graphs()

    def capture_decode_graphs(self, batch_sizes: Sequence[int], max_model_len: int, max_num_seqs: int,
                              graph_type: type[Graph] = CudaGraph) -> None:
        """At start-up: capture the decode forward for each batch size (see cuda_graphs.py)."""
        self.decode_graphs = DecodeGraphs(self._forward, sizes_to_capture(batch_sizes, max_num_seqs),
                                          max_model_len, self.block_size, self.device, graph_type)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        batches = [self._prepare_inputs(sched, group) for group in self._microbatches(sched)]
        batch = batches[0] if len(batches) == 1 else StepBatch.joined(batches)
        logits = self.decode_graphs.run(batch) if len(batches) == 1 else None
        if logits is None:
            logits = self.executor.forward([b.inputs for b in batches])
        states = [self.requests[r] for r in batch.sampling_req_ids]
        if sched.grammar_bitmask is not None:  # structured outputs: forbidden tokens to -inf
            apply_grammar_bitmask(logits, sched.grammar_bitmask, batch.row_keys)
        # a seeded draw depends on the position of the token it samples (see engine/sample)
        params, positions = [s.sampling_params for s in states], [len(s.token_ids) for s in states]
        if sched.spec_token_ids:  # drafts: the accepted ones and the target's own token
            verified = verify(logits, batch.drafts, params, positions, self.default_generator)
            tokens, logprobs = verified.token_ids, verified.logprobs
        else:
            sampled = sample(logits, params, positions, self.default_generator)
            tokens = [[t] for t in sampled.token_ids]
            logprobs = [None if lp is None else [lp] for lp in sampled.logprobs]
        out = ModelRunnerOutput()
        for state, drafts, token_ids, logprob in zip(states, batch.drafts, tokens, logprobs):
            state.token_ids.extend(token_ids)
            if drafts:  # the KV of rejected drafts is dead: it is overwritten from here on
                state.num_computed_tokens = len(state.token_ids) - 1
            out.sampled_token_ids[state.req_id] = token_ids
            if logprob is not None:
                out.logprobs[state.req_id] = logprob
        return out

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend, logits_indices)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.executor.export_blocks(block_ids)

    def _microbatches(self, sched: SchedulerOutput) -> list[list[str]]:
        """The step's requests, decodes first (the attention backend batches them together),
        cut into the pipeline's micro-batches of about equal token counts (one group
        without a pipeline)."""
        counts = sched.num_scheduled_tokens
        order = sorted(counts, key=lambda r: counts[r] != 1)
        parts = min(self.executor.num_microbatches, len(order))
        if parts <= 1:
            return [order]
        groups, current, done, total = [], [], 0, sum(counts.values())
        for i, req_id in enumerate(order):
            current.append(req_id)
            done += counts[req_id]
            left_groups, left_reqs = parts - len(groups) - 1, len(order) - i - 1
            if left_groups and (done >= total * (len(groups) + 1) / parts or left_reqs == left_groups):
                groups.append(current)
                current = []
        return groups + [current] if current else groups

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), list(new.block_ids), new.sampling_params, new.num_computed_tokens)
            if new.kv_load is not None:
                self.executor.import_blocks(new.kv_load.block_ids, new.kv_load.blocks)
        for cached in sched.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.num_kept_blocks is not None:  # blocks given back after rejected drafts
                del state.block_ids[cached.num_kept_blocks:]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, sched: SchedulerOutput, order: list[str]) -> StepBatch:
        """The flat batch of the requests `order` names (decodes first)."""
        num_decodes = sum(1 for r in order if sched.num_scheduled_tokens[r] == 1)
        input_ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], []
        logits_indices, sampling_req_ids, drafts_of = [], [], []
        bs = self.block_size
        for req_id in order:
            state, n = self.requests[req_id], sched.num_scheduled_tokens[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            drafts = sched.spec_token_ids.get(req_id, [])
            input_ids.extend(state.token_ids[start:end - len(drafts)] + drafts)
            positions.extend(range(start, end))
            slots.extend(state.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            tables.append(state.block_ids)
            state.num_computed_tokens = end
            if end == len(state.token_ids) + len(drafts):
                logits_indices.extend(range(starts[-1] - 1 - len(drafts), starts[-1]))
                sampling_req_ids.append(req_id)
                drafts_of.append(drafts)
        max_blocks = max(len(t) for t in tables)
        block_tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(sched.num_scheduled_tokens[r] for r in order), max_seq_len=max(seq_lens))
        return StepBatch(torch.tensor(input_ids, dtype=torch.long, device=dev),
                         torch.tensor(positions, dtype=torch.long, device=dev), meta,
                         torch.tensor(logits_indices, dtype=torch.long, device=dev), sampling_req_ids, drafts_of)
