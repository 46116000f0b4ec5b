"""The engine's load, read between steps. A worker reports it as the WorkerLoad message,
whose fields carry the same names (proto/pdserve/v1/common.proto)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding, since start: draft tokens proposed and scored, those accepted,
    and the verifications (one per request per step that had drafts)."""
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0

    def plus(self, num_proposed: int, num_accepted: int) -> SpecDecodeStats:
        """After one more verification."""
        return SpecDecodeStats(self.num_proposed_tokens + num_proposed, self.num_accepted_tokens + num_accepted,
                               self.num_verifications + 1)


@dataclass(frozen=True)
class HostTierStats:
    """The host tier (engine/core/host_tier.py; all 0 without one), since start: prompt tokens
    looked up there (those the device cache missed) and found, blocks copied device -> host
    and back; now: its slots in use and all of them."""
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_offloaded_blocks: int = 0
    num_onloaded_blocks: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0


@dataclass(frozen=True)
class QueuedPrefill:
    """Prefill work queued on an engine that a new request of `priority` and n prompt tokens
    may wait for: requests whose rank (engine/core/prefill_order.py: their place against a
    newcomer; it goes first when rank <= n) lies in (min_rank_tokens, max_rank_tokens], the
    lowest bucket holding every rank up to its max; and the prompt tokens they still need."""
    priority: int
    min_rank_tokens: int
    max_rank_tokens: int
    num_requests: int
    num_tokens: int


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0   # prompt tokens still to compute: the prefill work queued
    num_free_kv_blocks: int = 0
    num_total_kv_blocks: int = 0
    num_preemptions: int = 0             # since start: running requests preempted (their blocks freed)
    num_prefix_queried_tokens: int = 0   # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int = 0       # ...and found there
    prefill_tokens_per_s: float = 0.0    # measured over recent steps (engine/step_rates.py); 0: not yet
    decode_step_ms: float = 0.0          # a pure decode step of the recent batches; 0: not yet
    # the queued prefill work by priority and rank: what a new request would wait for
    queued_prefill: tuple[QueuedPrefill, ...] = ()
    # the bound on its next step as its running requests stand (SchedulerConfig's, or longer
    # for prompts alone: engine/core/step_bound.py); 0: tokens only
    max_step_ms: float = 0.0
    # the longest pause its running streams could take within their TPOT targets
    # (engine/core/tpot_room.py); inf: none keeps one
    tpot_stall_room_ms: float = math.inf
    spec: SpecDecodeStats = SpecDecodeStats()
    host: HostTierStats = HostTierStats()

    @property
    def kv_cache_usage(self) -> float:
        """The share of KV blocks in use by requests, 0-1 (cached blocks no request holds are free)."""
        if not self.num_total_kv_blocks:
            return 0.0
        return (self.num_total_kv_blocks - self.num_free_kv_blocks) / self.num_total_kv_blocks

    # flat names, as the WorkerLoad message and the metrics carry them
    @property
    def num_spec_proposed_tokens(self) -> int:
        return self.spec.num_proposed_tokens

    @property
    def num_spec_accepted_tokens(self) -> int:
        return self.spec.num_accepted_tokens

    @property
    def num_spec_verifications(self) -> int:
        return self.spec.num_verifications
