"""Exact verification of one-hot drafts: which drafts the target keeps, and its own next token.

A request with drafts [d1..dk] is scored at k+1 positions in one forward pass; row j holds
the target's logits for the token after d_j (row 0: after the last known token):

    rows:      r0        r1        ...  rk
    samples:   t0 ~ p0   t1 ~ p1        tk ~ pk        (the plain sampler, position pos + j)
    drafts:    d1        d2             -
    emitted:   d1..d_n, t_n   where n = the first j with t_j != d_{j+1} (n = k: all accepted,
                              and t_k is the bonus token)

Why sampling the target and comparing is rejection sampling, exactly. The textbook step
accepts draft d with probability min(1, p(d) / q(d)) and, on rejection, samples from the
residual normalize(max(0, p - q)). A proposer's q is one-hot on d (proposer.py), so the
acceptance probability is p(d) and the residual is p with d removed, renormalised. Drawing
t ~ p and accepting iff t == d has the same law: P(accept) = p(d), and a rejected t is
distributed as p conditioned on t != d, which is that residual. So every emitted token has
the target's distribution, and greedy (t = argmax) is the same rule.

What the coupling buys: each emitted token is the very token the plain sampler would draw
at its position from the same logits, with the same filters (temperature, top-k, top-p,
min-p) and the same noise: a seeded request (noise keyed by (seed, position)) produces the
same tokens with speculation as without, whatever the batch, and logprobs are the plain
step's. The price is a draw per scored row, accepted or not: k+1 rows, not a vocab-sized cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sample.sampler import sample
from pdserve.engine.sampling_params import SamplingParams

Logprob = tuple[float, dict[int, float]]  # (emitted token's logprob, {token_id: logprob} of the top N)


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]               # per request: the accepted drafts, then one target token
    logprobs: list[list[Logprob] | None]     # per request, one per emitted token; None if not asked for

    @property
    def num_accepted(self) -> list[int]:
        return [len(t) - 1 for t in self.token_ids]


def num_rows(drafts: list[list[int]]) -> int:
    """Rows of logits `verify` expects: each request's drafts plus one."""
    return sum(len(d) + 1 for d in drafts)


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           positions: list[int], generator: torch.Generator, raw_logits: torch.Tensor | None = None) -> VerifyOutput:
    """logits: [num_rows(drafts), vocab] float32, request after request, len(drafts[i]) + 1 rows
    for request i in the order above (a request without drafts has one row: a plain step).
    positions[i]: the sequence position of the first token request i samples (its number of
    tokens so far); row j of it samples position positions[i] + j. Penalties and masks
    (logits_processors.py) are already in `logits`, row j processed as if d1..d_j were
    accepted, so the coupling below holds for the processed distribution; raw_logits, as
    sample() takes them, give the logprobs."""
    _check_layout(logits, drafts, params, positions)
    row_params = [p for d, p in zip(drafts, params) for _ in range(len(d) + 1)]
    row_positions = [pos + j for d, pos in zip(drafts, positions) for j in range(len(d) + 1)]
    sampled = sample(logits, row_params, row_positions, generator, raw_logits)
    token_ids: list[list[int]] = []
    logprobs: list[list[Logprob] | None] = []
    row = 0
    for d, p in zip(drafts, params):
        targets = sampled.token_ids[row:row + len(d) + 1]
        n = _num_accepted(d, targets)
        token_ids.append(targets[:n + 1])  # == d[:n] + [targets[n]]
        logprobs.append(sampled.logprobs[row:row + n + 1] if p.logprobs is not None else None)
        row += len(d) + 1
    return VerifyOutput(token_ids, logprobs)


def _num_accepted(drafts: list[int], targets: list[int]) -> int:
    for j, d in enumerate(drafts):
        if d != targets[j]:
            return j
    return len(drafts)


def _check_layout(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
                  positions: list[int]) -> None:
    if len(params) != len(drafts) or len(positions) != len(drafts):
        raise ValueError(f"verify: drafts, params and positions must have one entry per request, "
                         f"got {len(drafts)}, {len(params)} and {len(positions)}")
    if logits.dim() != 2 or logits.shape[0] != num_rows(drafts):
        raise ValueError(f"verify: logits must be [num_rows(drafts)={num_rows(drafts)}, vocab], "
                         f"got {list(logits.shape)}")
