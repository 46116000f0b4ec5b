"""Turning logits into tokens: greedy, or temperature with top-k / top-p / min-p filters."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row, when asked for: (sampled token logprob, {token_id: logprob} of the top N)
    logprobs: list[tuple[float, dict[int, float]] | None]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], default_generator: torch.Generator) -> SamplerOutput:
    """logits: [num_rows, vocab] float32, one row per sampling request."""
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        probs = _filtered_probs(logits[random_rows], [params[i] for i in random_rows])
        for row, i in enumerate(random_rows):
            gen = generators[i] or default_generator
            token_ids[i] = torch.multinomial(probs[row], 1, generator=gen)[0]
    ids = token_ids.tolist()
    return SamplerOutput(ids, _logprobs(logits, params, ids))


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
