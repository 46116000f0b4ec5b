"""Placement strategies: which prefill or decode worker gets a request (when a worker takes
none: saturation.py; which path a request takes: paths.py). Pure functions of
`WorkerView` snapshots, so each is tested without gRPC; the router composes them
(placement.py chooses one per pool, slots.py applies it).
"""
from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.services.router.decide.saturation import prefill_backlog
from pdserve.services.router.decide.views import PrefixMatch, WorkerView

# why a worker was chosen: the `reason` label of router_placement_total
LEAST_LOADED = "least_loaded"        # load decided (nothing else told the candidates apart)
MOST_ROOM = "most_room"              # MostRoomDecode's room score
AFFINITY = "affinity"                # the prompt's first-block affinity worker
AFFINITY_OVERLOAD = "affinity_overload"  # its affinity worker was too loaded: the least loaded instead
KV_HIT = "kv_hit"                    # it holds the most of the prompt's prefix (more than another candidate)
KV_HOST_HIT = "kv_host_hit"          # as kv_hit, and part of what it holds is in host memory (a copy back)
KV_LOAD = "kv_load_over_hit"         # another candidate held more of the prefix but was more loaded


@dataclass(frozen=True)
class Placement:
    worker: WorkerView
    reason: str
    # prompt tokens the worker is expected to reuse rather than compute: the pool counts
    # only the rest as outstanding on it (its in-flight tokens, see prefill_backlog)
    num_cached_tokens: int = 0


class WorkerPolicy(ABC):
    """Chooses one pool's worker for a request."""

    reason = LEAST_LOADED  # what `place` reports for a policy with one reason

    @abstractmethod
    def choose(self, candidates: Sequence[WorkerView], prompt_token_ids: Sequence[int]) -> WorkerView | None:
        """A worker among `candidates` (all up, none saturated); None when there is none."""

    def place(self, candidates: Sequence[WorkerView], prompt_token_ids: Sequence[int]) -> Placement | None:
        """`choose` and why (for the router's metrics)."""
        worker = self.choose(candidates, prompt_token_ids)
        return None if worker is None else Placement(worker, self.reason)


class CountedPolicy(WorkerPolicy):
    """Wraps a policy and reports each decision's reason to `count` (router_placement_total)."""

    def __init__(self, policy: WorkerPolicy, count: Callable[[str], None]):
        self.policy, self.count = policy, count

    def choose(self, candidates, prompt_token_ids):
        placement = self.place(candidates, prompt_token_ids)
        return None if placement is None else placement.worker

    def place(self, candidates, prompt_token_ids):
        placement = self.policy.place(candidates, prompt_token_ids)
        if placement is not None:
            self.count(placement.reason)
        return placement


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
        placement = self.place(candidates, prompt_token_ids)
        return None if placement is None else placement.worker

    def place(self, candidates, prompt_token_ids):
        least = self._fallback.choose(candidates, prompt_token_ids)
        if least is None:
            return None
        preferred = self.preferred(candidates, prompt_token_ids)
        if preferred is None:
            return Placement(least, LEAST_LOADED)
        if prefill_backlog(preferred) - prefill_backlog(least) > self.max_extra_tokens:
            return Placement(least, AFFINITY_OVERLOAD)
        return Placement(preferred, AFFINITY)

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

    reason = MOST_ROOM

    def choose(self, candidates, prompt_token_ids=()):
        return min(candidates, key=decode_score, default=None)


# queued prefill tokens that weigh as much as a full batch: one default step budget
PREFILL_BACKLOG_SCALE = 2048


def decode_score(w: WorkerView) -> float:
    return room_terms(w) + prefill_backlog(w) / PREFILL_BACKLOG_SCALE


def room_terms(w: WorkerView) -> float:
    """The share of batch slots taken plus the share of KV blocks in use (each 0..1)."""
    # between polls the router's own count is the fresher lower bound
    num_seqs = max(w.num_running + w.num_waiting, w.in_flight)
    seq_share = num_seqs / w.max_num_seqs if w.max_num_seqs else float(num_seqs)
    used_share = 1.0 - w.num_free_kv_blocks / w.num_total_kv_blocks if w.num_total_kv_blocks else 0.0
    return seq_share + used_share


class KVAwarePlacement(WorkerPolicy):
    """The worker where the request's first token comes soonest, by what the router's
    KV index (state/kv_index.py) says each candidate holds of the prompt's prefix:

        score(w) = saved_tokens(w) - load_tokens(w)
        saved_tokens(w) = device(w) + host_weight * host(w)
                          + store_weight * max(0, store - device(w) - host(w))

    `device(w)`: prompt tokens in w's device prefix cache (leading blocks, by hash), free
    to reuse; `host(w)`: the run right after them in w's host memory, reused after a copy
    back (hence `host_weight` < 1); `store`: those in the kvstore, which every worker can
    import, at a transfer's cost (hence `store_weight` <= `host_weight`, and the same for
    every candidate). `load_tokens` is the prefill work ahead of the request
    (prefill_load_tokens / decode_load_tokens): a worker's prompt tokens to compute before
    this one's, and what a saved token is worth, are both prefill tokens, so the difference
    estimates the wait. The best score wins; ties go to the least loaded, then to the
    first listed.

        prompt      [ system | turn 1 | answer 1 | turn 2 ]
        worker A      ████████████████████████             device 1500, load 300  -> +1200
        worker B      ████████░░░░░░░░░░░░░░░░             device 400 + 0.8 * host 1100,
                      (█ device, ░ host memory)            load 0                 -> +1280
    """

    def __init__(self, match: Callable[[Sequence[str], Sequence[int]], PrefixMatch],
                 load: Callable[[WorkerView], float], store_weight: float = 0.5, host_weight: float = 0.8):
        self.match, self.load = match, load
        self.store_weight, self.host_weight = store_weight, host_weight

    def choose(self, candidates, prompt_token_ids):
        placement = self.place(candidates, prompt_token_ids)
        return None if placement is None else placement.worker

    def place(self, candidates, prompt_token_ids):
        if not candidates:
            return None
        found = self.match([w.address for w in candidates], prompt_token_ids)
        saved = [self._saved(found, w.address) for w in candidates]
        loads = [self.load(w) for w in candidates]
        best = max(range(len(candidates)), key=lambda i: (saved[i] - loads[i], -loads[i]))
        if saved[best] < max(saved):
            reason = KV_LOAD
        elif saved[best] > min(saved):
            reason = KV_HOST_HIT if found.host_tokens.get(candidates[best].address, 0) else KV_HIT
        else:
            reason = LEAST_LOADED
        return Placement(candidates[best], reason, int(saved[best]))

    def _saved(self, found: PrefixMatch, address: str) -> float:
        return kv_saved_tokens(found.local_tokens.get(address, 0), found.store_tokens, self.store_weight,
                               host_tokens=found.host_tokens.get(address, 0), host_weight=self.host_weight)


def kv_saved_tokens(local_tokens: int, store_tokens: int, store_weight: float, *,
                    host_tokens: int = 0, host_weight: float = 0.8) -> float:
    """Prompt tokens a worker need not compute: its device cache's, then (worth less: a copy
    back) its host memory's after them, then (worth least: they travel) the kvstore's
    beyond both."""
    held = local_tokens + host_tokens
    return local_tokens + host_weight * host_tokens + store_weight * max(0, store_tokens - held)


def prefill_load_tokens(w: WorkerView) -> float:
    """A prefill worker's load in tokens: its prefill backlog."""
    return prefill_backlog(w)


def decode_load_tokens(w: WorkerView) -> float:
    """A decode worker's load in tokens, for placing prompts it prefills itself (the
    direct path, colocated serving): MostRoomDecode's score at PREFILL_BACKLOG_SCALE tokens
    for a full batch, so that with no prefix to reuse both policies choose alike. Its
    backlog term keeps this router's in-flight prompt tokens for as long as the streams
    run: measured on the goodput mix (docs/benchmarks_history.md, issue 13), leaving them
    out sent new streams to workers still decoding long prompts and lowered colocated
    goodput."""
    return PREFILL_BACKLOG_SCALE * decode_score(w)