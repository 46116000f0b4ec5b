"""Sizing the KV cache of a CUDA engine as vLLM does (`gpu_memory_utilization`): the engine
may use that share of the whole device; what the weights, everything else on the device and
the activation peak of the largest step leave of it is the KV cache's.

    |<──────────── total x gpu_memory_utilization ────────────>|
    [ in use after the weights | activation peak | KV cache    ][ left to others ]
      (mem_get_info: this         (profile run)    (the rest)
       process's and others')

The activation peak is measured, not guessed (vLLM's profile_run): one dummy step of
max_num_batched_tokens tokens, its logits and the sampler over max_num_seqs rows, with
torch's peak allocation counter reset before it. The step needs somewhere to write its K/V:
a cache of just the blocks its own tokens fill, allocated before the counter starts (so it
is not counted as activations) and freed after. The CPU never runs it (kv_cache.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelArchConfig
from pdserve.engine.sample.logits_processors import RowHistory, process_logits
from pdserve.engine.sample.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker.kv_cache import allocate_kv_caches
from pdserve.engine.worker.step_batch import StepInputs

GiB = 1 << 30
# the sampler's costliest path: a sort of every row for top-p, after every logits processor
# (penalties build count matrices as large as the logits)
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.1,
                                   presence_penalty=0.1, logit_bias={0: 1.0}, allowed_token_ids=[0], min_tokens=1)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int            # the device's memory
    in_use_bytes: int           # in use once the weights are loaded, by this process and any other
    activation_peak_bytes: int  # the profile step's peak allocation above that

    def kv_budget(self, gpu_memory_utilization: float) -> int:
        return kv_budget_bytes(self.total_bytes, self.in_use_bytes, self.activation_peak_bytes,
                               gpu_memory_utilization)


def kv_budget_bytes(total_bytes: int, in_use_bytes: int, activation_peak_bytes: int,
                    gpu_memory_utilization: float) -> int:
    """utilization x total - (in use after the weights + activation peak); raises ValueError
    naming gpu_memory_utilization, with the numbers, when that leaves nothing."""
    allowed = int(total_bytes * gpu_memory_utilization)
    budget = allowed - in_use_bytes - activation_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization:g} of the device's {_gib(total_bytes)} is "
            f"{_gib(allowed)}, but {_gib(in_use_bytes)} are in use after loading the weights (by this process "
            f"and any other) and a step's activations peak at {_gib(activation_peak_bytes)}: nothing is left "
            "for the KV cache; raise gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, "
            "or set kv_cache_memory_bytes")
    return budget


def profile_batch(num_tokens: int, max_seq_len: int, num_logits: int, block_size: int,
                  device: torch.device) -> tuple[StepInputs, int]:
    """The dummy step: `num_tokens` prompt tokens in sequences of at most `max_seq_len` (the
    longest prefill one step holds), the shorter rest first; `num_logits` rows of logits.
    Returns the inputs and the number of KV blocks they write to (blocks 0, 1, ... in order).

        num_tokens 40, max_seq_len 16, block_size 8:  seqs [8][16][16], blocks [0][1 2][3 4]
    """
    full, rest = divmod(num_tokens, max_seq_len)
    lengths = ([rest] if rest else []) + [max_seq_len] * full
    starts, slots, tables, next_block = [0], [], [], 0
    for n in lengths:
        blocks = list(range(next_block, next_block + -(-n // block_size)))
        next_block += len(blocks)
        starts.append(starts[-1] + n)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
        tables.append(blocks)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        num_decodes=int(lengths[0] == 1),  # a one-token sequence is a decode to the backend
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(lengths), max_seq_len=max(lengths))
    positions = [p for n in lengths for p in range(n)]
    num_logits = min(num_logits, num_tokens)
    inputs = StepInputs(torch.zeros(num_tokens, dtype=torch.long, device=device),
                        torch.tensor(positions, dtype=torch.long, device=device), meta,
                        torch.arange(num_tokens - num_logits, num_tokens, dtype=torch.long, device=device))
    return inputs, next_block


def run_profile_step(model, backend: AttentionBackend, inputs: StepInputs, kv_caches: list[torch.Tensor]) -> None:
    """The dummy step itself: the forward, then the sampler over its logits rows."""
    logits = model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta, backend, inputs.logits_indices)
    rows = logits.shape[0]
    generator = torch.Generator(device=logits.device)
    prompt = torch.zeros(1, dtype=torch.long, device=logits.device)
    processed = process_logits(logits, [RowHistory(_PROFILE_SAMPLING, [0], prompt)] * rows, frozenset({0}))
    sample(processed, [_PROFILE_SAMPLING] * rows, [0] * rows, generator, logits)


def profile_memory(model, backend: AttentionBackend, kv_arch: ModelArchConfig, block_size: int,
                   dtype: torch.dtype, device: torch.device, num_tokens: int, max_seq_len: int,
                   num_logits: int) -> MemoryProfile:
    """On CUDA, after the weights are loaded and before the KV cache is: the device's memory,
    what is in use, and the activation peak of the dummy step. In use is read after the step
    (its memory freed): the CUDA libraries' workspaces it made are the engine's from now on."""
    inputs, num_blocks = profile_batch(num_tokens, max_seq_len, num_logits, block_size, device)
    kv_caches = allocate_kv_caches(num_blocks, kv_arch, block_size, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_profile_step(model, backend, inputs, kv_caches)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv_caches, inputs
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total, total - free, peak)


def describe(profile: MemoryProfile, gpu_memory_utilization: float) -> str:
    """The start-up log's account of the sizing."""
    return (f"memory: {gpu_memory_utilization:g} x {_gib(profile.total_bytes)} total, {_gib(profile.in_use_bytes)} "
            f"in use after the weights, activation peak {_gib(profile.activation_peak_bytes)}: KV cache budget "
            f"{_gib(profile.kv_budget(gpu_memory_utilization))}")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
