"""What the routing decisions read: immutable snapshots of each worker and of the prefix
each could reuse. The router's state (state/) produces them from polls and KV events;
the simulator makes them up; the decisions never ask where they came from.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

# the engine's own report, pure data: one shape from the engine's stats through WorkerLoad to here
from pdserve.engine.stats import QueuedPrefill  # noqa: F401  (re-exported for the simulator)

PREFILL = "prefill"
DECODE = "decode"
POOLS = (PREFILL, DECODE)


@dataclass(frozen=True)
class WorkerView:
    address: str
    up: bool = False
    # as the worker last reported them (WorkerLoad, under the same names)
    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0
    num_free_kv_blocks: int = 0
    num_total_kv_blocks: int = 0
    max_num_seqs: int = 0
    draining: bool = False
    prefill_tokens_per_s: float = 0.0  # measured by the worker; 0: not yet
    decode_step_ms: float = 0.0
    # its queued prefill work as its scheduling order ranks it against a newcomer (empty:
    # none queued, or a worker that does not report it), and its bound on a step (0: none)
    queued_prefill: tuple[QueuedPrefill, ...] = ()
    max_step_ms: float = 0.0
    # the longest pause its running streams could take within their TPOT targets (inf: none
    # keeps one; 0: no room, or a worker that does not report it): what a rescued prompt may cost them
    tpot_stall_room_ms: float = 0.0
    # what this router itself has outstanding on the worker
    in_flight: int = 0
    in_flight_tokens: int = 0   # their prompt tokens
    # prompt tokens this router sent since the worker's last report, which cannot hold them
    # yet (kept until the next report even when they end sooner: at most a poll's interval)
    unreported_tokens: int = 0

    def reserved(self, num_requests: int, num_tokens: int) -> WorkerView:
        """After this router sends (or, negative, ends) requests on the worker."""
        return replace(self, in_flight=self.in_flight + num_requests, in_flight_tokens=self.in_flight_tokens + num_tokens,
                       unreported_tokens=self.unreported_tokens + max(0, num_tokens))


@dataclass(frozen=True)
class PrefixMatch:
    """What each candidate could reuse of one prompt, in tokens, by tier:

        prompt      [ b0 | b1 | b2 | b3 | b4 | b5 | t ]
        worker w      device    | host    |                local_tokens[w], then host_tokens[w]
        kvstore       store                   |            store_tokens (from b0, for any worker)
    """
    local_tokens: dict[str, int] = field(default_factory=dict)  # by worker address: its device prefix cache
    store_tokens: int = 0                                        # the kvstore: any worker can import these
    # by worker address: in its host memory, the run right after its device run (a copy back);
    # absent: none (an index without tiers, the simulator's)
    host_tokens: dict[str, int] = field(default_factory=dict)


class PrefixIndex(ABC):
    """Which of a prompt's leading blocks each source holds (state/kv_index.py KVIndex,
    fed by the workers' KV events)."""

    @abstractmethod
    def match(self, addresses: Sequence[str], token_ids: Sequence[int], store: str = "") -> PrefixMatch:
        """The prompt's reusable prefix on each of `addresses`, and in the kvstore `store`."""


class NoPrefixes(PrefixIndex):
    """An index that knows of no block anywhere: placement then decides by load alone
    (the simulator, which models no KV events)."""

    def match(self, addresses, token_ids, store=""):
        return PrefixMatch({a: 0 for a in addresses}, 0)
