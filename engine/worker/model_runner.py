"""Executes one scheduled step: keeps per-request token and block state, packs the flat
batch, runs the model once (eagerly, or replaying a captured decode graph) and samples."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.engine.core.scheduler_output import ModelRunnerOutput, PromptLogprobRows, SchedulerOutput
from pdserve.engine.model.decoder import DecoderForCausalLM
from pdserve.engine.model.packed_linear import can_prepack
from pdserve.engine.sample.logits_processors import RowHistory, process_logits
from pdserve.engine.sample.sampler import sample
from pdserve.engine.spec_decode.rejection import verify
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker.cuda_graphs import CudaGraph, DecodeGraphs, Graph, NoDecodeGraphs, sizes_to_capture
from pdserve.engine.structured.grammar import apply_grammar_bitmask
from pdserve.engine.worker.step_batch import PromptRows, StepBatch

if TYPE_CHECKING:
    from pdserve.engine.worker.step_batch import StepInputs


class Forwarder(Protocol):
    """What the runner needs of the engine's executor (engine/executor/base.py), which
    sits above it: the forward and the KV copies, on however many ranks."""
    num_microbatches: int

    def forward(self, batches: list[StepInputs]) -> torch.Tensor: ...
    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None: ...
    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor: ...
    def copy_host_blocks(self, offloads: list[tuple[int, int]], onloads: list[tuple[int, int]]) -> None: ...


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int = 0
    num_prompt_tokens: int = 0  # token_ids[num_prompt_tokens:] is the output, wherever it was generated
    _prompt_ids: torch.Tensor | None = None

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        """The prompt as a tensor, built once (repetition_penalty reads it every step)."""
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(self.token_ids[:self.num_prompt_tokens], dtype=torch.long, device=device)
        return self._prompt_ids

    def histories(self, drafts: list[int], device: torch.device) -> list[RowHistory]:
        """One per scored row: row j sees the output as if drafts[:j] were accepted (a row
        that processes nothing, beside others that do, reads none)."""
        output = self.token_ids[self.num_prompt_tokens:] if self.sampling_params.processes_logits else []
        prompt = self.prompt_ids(device) if self.sampling_params.repetition_penalty != 1.0 else None
        return [RowHistory(self.sampling_params, output + drafts[:j], prompt) for j in range(len(drafts) + 1)]


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor], block_size: int,
                 backend: AttentionBackend, device: torch.device, seed: int = 0, *, executor: Forwarder,
                 eos_token_ids: frozenset[int] = frozenset()):
        """`executor` runs every eager forward, on one rank or t x p (`model` and
        `kv_caches` are then rank 0's parts); a captured decode graph runs `model` here.
        `eos_token_ids`: what min_tokens masks (with each request's stop_token_ids)."""
        self.eos_token_ids = eos_token_ids
        self.model = model
        self.executor = executor
        if can_prepack(device, model.dtype):
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
        # the host tier's copies before anything writes the cache: an evicted block's old
        # bytes leave before its new owner's (an onload, an import, the forward) arrive
        if sched.has_host_copies:
            self.executor.copy_host_blocks(sched.kv_offloads, sched.kv_onloads)
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput()
        batches = [self._prepare_inputs(sched, group) for group in self._microbatches(sched)]
        batch = batches[0] if len(batches) == 1 else StepBatch.joined(batches)
        logits = self.decode_graphs.run(batch) if len(batches) == 1 else None
        if logits is None:
            logits = self.executor.forward([b.inputs for b in batches])
        logits, prompt_logits = batch.split_logits(logits)
        states = [self.requests[r] for r in batch.sampling_req_ids]
        if sched.grammar_bitmask is not None:  # structured outputs: forbidden tokens to -inf
            apply_grammar_bitmask(logits, sched.grammar_bitmask, batch.row_keys)
        # a seeded draw depends on the position of the token it samples (see engine/sample)
        params, positions = [s.sampling_params for s in states], [len(s.token_ids) for s in states]
        raw_logits = logits  # logprobs are of these (vLLM's raw_logprobs)
        if any(p.processes_logits for p in params):  # penalties, bias, masks: before temperature
            histories = [h for s, d in zip(states, batch.drafts) for h in s.histories(d, self.device)]
            logits = process_logits(logits, histories, self.eos_token_ids)
        if sched.spec_token_ids:  # drafts: the accepted ones and the target's own token
            verified = verify(logits, batch.drafts, params, positions, self.default_generator, raw_logits)
            tokens, logprobs = verified.token_ids, verified.logprobs
        else:
            sampled = sample(logits, params, positions, self.default_generator, raw_logits)
            tokens = [[t] for t in sampled.token_ids]
            logprobs = [None if lp is None else [lp] for lp in sampled.logprobs]
        out = ModelRunnerOutput()
        if prompt_logits is not None:
            out.prompt_logprobs = self._prompt_logprobs(prompt_logits, batch.prompt_rows)
        for state, drafts, token_ids, logprob in zip(states, batch.drafts, tokens, logprobs):
            state.token_ids.extend(token_ids)
            if drafts:  # the KV of rejected drafts is dead: it is overwritten from here on
                state.num_computed_tokens = len(state.token_ids) - 1
            out.sampled_token_ids[state.req_id] = token_ids
            if logprob is not None:
                out.logprobs[state.req_id] = logprob
        return out

    def _prompt_logprobs(self, logits: torch.Tensor, rows: list[PromptRows]) -> dict[str, PromptLogprobRows]:
        """Each row's log_softmax of the raw logits (vLLM's: before any sampling field) at the
        prompt token that follows it, that token's rank (vLLM's: how many tokens are at least
        as likely) and the top N."""
        logprobs, out, at = logits.log_softmax(dim=-1), {}, 0
        for r in rows:
            state, part = self.requests[r.req_id], logprobs[at:at + r.num]
            at += r.num
            target_ids = state.token_ids[r.start + 1:r.start + 1 + r.num]
            targets = torch.tensor(target_ids, dtype=torch.long, device=part.device)
            chosen = part.gather(1, targets[:, None])
            ranks = (part >= chosen).sum(dim=1)
            n = state.sampling_params.prompt_logprobs
            top: list[dict[int, float]] = [{} for _ in target_ids]
            if n:
                values, indices = part.topk(n, dim=-1)
                top = [dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            out[r.req_id] = PromptLogprobRows(r.start + 1, target_ids, chosen[:, 0].tolist(), ranks.tolist(), top)
        return out

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend, logits_indices)

    def export_blocks(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        return self.executor.export_blocks(block_ids, out)

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
            num_prompt = len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), list(new.block_ids), new.sampling_params, new.num_computed_tokens,
                num_prompt)
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
        prompt_indices, prompt_rows = [], []
        bs = self.block_size
        for req_id in order:
            state, n = self.requests[req_id], sched.num_scheduled_tokens[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            drafts = sched.spec_token_ids.get(req_id, [])
            input_ids.extend(state.token_ids[start:end - len(drafts)] + drafts)
            if (rows := _prompt_rows(state, start, end)) is not None:
                prompt_indices.extend(range(starts[-1], starts[-1] + rows.num))
                prompt_rows.append(rows)
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
                         torch.tensor(logits_indices + prompt_indices, dtype=torch.long, device=dev),
                         sampling_req_ids, drafts_of, prompt_rows)


def _prompt_rows(state: CachedRequestState, start: int, end: int) -> PromptRows | None:
    """The rows of this chunk (positions start..end-1) whose logits score a prompt token, for
    a request with prompt_logprobs: every position before the prompt's last (whose logits
    sample the first output token instead)."""
    last = min(end, state.num_prompt_tokens - 1)
    if state.sampling_params.prompt_logprobs is None or start >= last:
        return None
    return PromptRows(state.req_id, start, last - start)
