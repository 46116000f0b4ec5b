"""The proposer contract: what every way of guessing draft tokens implements.

Each step, before scheduling, the engine asks the proposer for drafts for the running
requests that are decoding (every known token computed but the last sampled one):

    DraftRequest(req_id, token_ids=[prompt..., outputs...], max_drafts=k')
        ──propose──▶ {req_id: [d1, d2, ...]}   (0 to k' tokens each)

The target then scores [last token, d1, ..., dk] in one forward pass and keeps the
accepted prefix plus one token of its own (rejection.py). A proposer sees only token
ids: it never learns which drafts were accepted except through the next call's
token_ids, which then end with the accepted ones. `max_drafts` already respects the
request's max_tokens and the context, so a proposer may always return that many.

Drafts are deterministic guesses (a distribution q that is one-hot on each draft token):
that is what makes the verification in rejection.py exact for the target's sampling
distribution. A proposer that samples its drafts would have to return q as well.

EAGLE or Medusa heads fit the same contract (they would read the target's hidden states
through a hook, not through this interface); none is trained for SmolLM2, so none is here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class DraftRequest:
    req_id: str
    token_ids: list[int]  # the request's tokens so far, prompt and output; the last is not computed yet
    max_drafts: int       # at most this many drafts (>= 1)


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Draft tokens per request id (a request may get none)."""

    def finish(self, req_id: str) -> None:
        """The request ended or was preempted: free whatever the proposer holds for it."""

    def close(self) -> None:
        """The engine is shutting down."""


class NoProposer(Proposer):
    """An engine without speculative decoding: nothing is ever proposed."""

    def propose(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        return {}
