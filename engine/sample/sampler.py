"""Turning logits into tokens: greedy, or temperature with top-k / top-p / min-p filters.

A seeded request's draw depends only on (seed, position): the token at sequence position
p is sampled with noise hashed from the seed and p, never from a generator's running
state. So any engine continues a seeded request exactly where another left off (the
prefill worker samples the first token, a decode worker the rest, a migrated request
resumes on a third) and preemption by recompute repeats nothing. Unseeded rows draw from
the engine's one generator, all in one call.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
_MIX32 = 0x45D9F3B  # < 2^31: a 32-bit value times it stays within int64


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row, when asked for: (sampled token logprob, {token_id: logprob} of the top N)
    logprobs: list[tuple[float, dict[int, float]] | None]


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           default_generator: torch.Generator, raw_logits: torch.Tensor | None = None) -> SamplerOutput:
    """logits: [num_rows, vocab] float32, one row per sampling request; positions[i]: the
    sequence position of the token row i samples (its number of tokens so far). raw_logits:
    the same rows before logits_processors.py, which logprobs are of (vLLM's default,
    raw_logprobs: the model's distribution, grammar-masked, before penalties, bias and
    temperature); None: `logits` are raw."""
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        probs = _filtered_probs(logits[random_rows], [params[i] for i in random_rows])
        seeded = [row for row, i in enumerate(random_rows) if params[i].seed is not None]
        unseeded = [row for row, i in enumerate(random_rows) if params[i].seed is None]
        picked = torch.empty(len(random_rows), dtype=token_ids.dtype, device=logits.device)
        if unseeded:
            picked[unseeded] = torch.multinomial(probs[unseeded], 1, generator=default_generator)[:, 0]
        if seeded:
            keys = [(params[random_rows[row]].seed, positions[random_rows[row]]) for row in seeded]
            picked[seeded] = seeded_sample(probs[seeded], keys)
        token_ids[random_rows] = picked
    ids = token_ids.tolist()
    return SamplerOutput(ids, _logprobs(logits if raw_logits is None else raw_logits, params, ids))


def seeded_sample(probs: torch.Tensor, keys: list[tuple[int, int]]) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab], drawn with the noise of its (seed,
    position) key: the exponential race argmax(p / E), E ~ Exp(1) per token, picks token
    v with probability p[v] (the Gumbel-max trick), and E comes from a counter-based hash,
    so the same key always gives the same draw, whatever else is in the batch."""
    vocab = probs.shape[-1]
    k1, k2 = torch.tensor([_row_key(seed, pos) for seed, pos in keys], dtype=torch.int64,
                          device=probs.device).unbind(-1)
    v = torch.arange(vocab, dtype=torch.int64, device=probs.device)
    h = _mix32(_mix32(v[None, :] ^ k1[:, None]) ^ k2[:, None])
    uniform = (h.to(torch.float64) + 0.5) / 2.0 ** 32  # in (0, 1)
    exponential = -torch.log(uniform)
    return (probs.to(torch.float64) / exponential).argmax(dim=-1)


def _row_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys from (seed, position); a cryptographic hash so nearby seeds and
    positions give unrelated noise."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 tensors holding 32-bit values."""
    x = (((x >> 16) ^ x) * _MIX32) & _MASK32
    x = (((x >> 16) ^ x) * _MIX32) & _MASK32
    return (x >> 16) ^ x


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature[:, None]
    if any(p.top_k > 0 for p in params):
        logits = _apply_top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = _apply_top_p(logits, [p.top_p for p in params])
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = (cum - sorted_logits.softmax(dim=-1)) >= p[:, None]  # mass before this token already >= p
    remove[:, 0] = False
    return logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))


def _logprobs(logits: torch.Tensor, params: list[SamplingParams], ids: list[int]):
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
    if not wanted:
        return out
    logprobs = logits[wanted].log_softmax(dim=-1)
    for row, i in enumerate(wanted):
        n = params[i].logprobs
        top = {}
        if n:
            values, indices = logprobs[row].topk(n)
            top = dict(zip(indices.tolist(), values.tolist()))
        out[i] = (logprobs[row, ids[i]].item(), top)
    return out
