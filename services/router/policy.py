"""Routing policies: which path a request takes, when a worker is saturated, and which
prefill or decode worker gets a request. Pure functions of `WorkerView` snapshots, so
each is tested without gRPC; the router composes them (see pools.py).
"""
from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence

from services.router.config import SaturationConfig, SLOClass
from services.router.workers import WorkerView

DIRECT = "direct"                  # a decode worker prefills the prompt itself
DISAGGREGATED = "disaggregated"    # prefill pool -> kvstore -> decode pool


class PathPolicy:
    """Short prompts go straight to a decode worker: their prefill costs less than moving
    their KV. A class may set its own threshold (0: always through the prefill pool).
    `colocated`: there is no prefill pool; every decode worker prefills its own prompts
    (the classic one-engine-per-replica deployment, for comparison or small models)."""

    def __init__(self, short_prompt_tokens: int, slo_classes: dict[str, SLOClass], colocated: bool = False):
        self._default = short_prompt_tokens
        self._per_class = {name: c.short_prompt_tokens for name, c in slo_classes.items()
                           if c.short_prompt_tokens is not None}
        self.colocated = colocated

    def choose(self, num_prompt_tokens: int, slo_class: str) -> str:
        if self.colocated:
            return DIRECT
        limit = self._per_class.get(slo_class, self._default)
        return DIRECT if num_prompt_tokens <= limit else DISAGGREGATED


class SaturationPolicy:
    """A saturated worker takes no new work from this router; when every reachable worker
    of a pool is saturated, requests wait in the admission queue (or are refused)."""

    def __init__(self, cfg: SaturationConfig):
        self.cfg = cfg

    def is_saturated(self, w: WorkerView) -> bool:
        c = self.cfg
        no_room = w.num_total_kv_blocks > 0 and w.num_free_kv_blocks < c.min_free_kv_blocks
        return (w.draining or w.num_waiting >= c.max_waiting or w.in_flight >= c.max_in_flight_per_worker
                or prefill_backlog(w) >= c.max_queued_prefill_tokens or no_room)


def prefill_backlog(w: WorkerView) -> int:
    """Prompt tokens waiting on a prefill worker. The worker's report is one poll old and
    this router's own outstanding tokens are exact for its requests: take the larger."""
    return max(w.num_queued_prefill_tokens, w.in_flight_tokens)


class WorkerPolicy(ABC):
    """Chooses one pool's worker for a request."""

    @abstractmethod
    def choose(self, candidates: Sequence[WorkerView], prompt_token_ids: Sequence[int]) -> WorkerView | None:
        """A worker among `candidates` (all up, none saturated); None when there is none."""


class LeastQueuedPrefill(WorkerPolicy):
    """The worker with the fewest queued prefill tokens (first listed on ties)."""

    def choose(self, candidates, prompt_token_ids):
        return min(candidates, key=prefill_backlog, default=None)


class PrefixAffinityPrefill(WorkerPolicy):
    """Prompts that share their leading block go to the same worker, whose prefix cache
    then already holds it; unless that costs more than `max_extra_tokens` of queue over
    the least-loaded worker, then the least-loaded one takes it (the overload escape).

    The preferred worker is chosen by rendezvous hashing of (prefix, address): it stays
    the same while workers come and go, and when it is saturated (absent from the
    candidates) the prefix's second choice is just as stable.

        prompt  [ t0 .. t15 | t16 ... ]      hash(t0..t15, address) highest -> preferred
                  ^ affinity block
    """

    def __init__(self, max_extra_tokens: int, prefix_tokens: int = 16):
        self.max_extra_tokens = max_extra_tokens
        self.prefix_tokens = prefix_tokens
        self._fallback = LeastQueuedPrefill()

    def choose(self, candidates, prompt_token_ids):
        least = self._fallback.choose(candidates, prompt_token_ids)
        preferred = self.preferred(candidates, prompt_token_ids)
        if preferred is None or prefill_backlog(preferred) - prefill_backlog(least) > self.max_extra_tokens:
            return least
        return preferred

    def preferred(self, candidates: Sequence[WorkerView], prompt_token_ids: Sequence[int]) -> WorkerView | None:
        """The prompt's affinity worker; None without candidates or a full leading block."""
        if not candidates or len(prompt_token_ids) < self.prefix_tokens:
            return None
        key = prefix_key(prompt_token_ids[: self.prefix_tokens])
        return max(candidates, key=lambda w: _rendezvous(key, w.address))


def prefix_key(token_ids: Sequence[int]) -> bytes:
    """A stable digest of token ids (never Python's hash(): it differs per process)."""
    return hashlib.blake2b(struct.pack(f"<{len(token_ids)}i", *token_ids), digest_size=16).digest()


def _rendezvous(key: bytes, address: str) -> bytes:
    return hashlib.blake2b(key + address.encode(), digest_size=8).digest()


class MostRoomDecode(WorkerPolicy):
    """The worker with the most room: the fewest sequences per batch slot plus the
    smallest share of KV blocks in use (each term 0..1), plus the prompt tokens it still
    has to prefill. Fewer running sequences keeps ITL low; free blocks keep a new request
    from preempting running ones; a worker prefilling long direct-path prompts (colocated
    serving) stretches every step of its batch until it is done."""

    def choose(self, candidates, prompt_token_ids=()):
        return min(candidates, key=decode_score, default=None)


# queued prefill tokens that weigh as much as a full batch: one default step budget
PREFILL_BACKLOG_SCALE = 2048


def decode_score(w: WorkerView) -> float:
    # between polls the router's own count is the fresher lower bound
    num_seqs = max(w.num_running + w.num_waiting, w.in_flight)
    seq_share = num_seqs / w.max_num_seqs if w.max_num_seqs else float(num_seqs)
    used_share = 1.0 - w.num_free_kv_blocks / w.num_total_kv_blocks if w.num_total_kv_blocks else 0.0
    return seq_share + used_share + prefill_backlog(w) / PREFILL_BACKLOG_SCALE
