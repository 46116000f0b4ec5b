"""A request's life inside the engine core: tokens, progress, status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # engine_request.py imports RequestMode from here
    from pdserve.engine.engine_request import EngineRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # structured outputs: its grammar is compiling
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # prefill-only: the first token is sampled and the KV exported; a decode worker goes on
    FINISHED_HANDOFF = "handoff"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.RUNNING,
                            RequestStatus.PREEMPTED)


class RequestMode(enum.Enum):
    """What an engine does with a request; disaggregation splits one request in two.

    A prefill-only request emits exactly one token, the first, and then ends: with a real
    finish reason when that token already ends the request (EOS, a stop, max_tokens 1, the
    context full), else FINISHED_HANDOFF with the prompt's KV exported on its output. A
    decode-only request continues one of those: `output_token_ids` holds the tokens emitted
    elsewhere and the KV may arrive as an import.
    """
    COLOCATED = "colocated"
    PREFILL_ONLY = "prefill_only"
    DECODE_ONLY = "decode_only"


@dataclass(frozen=True)
class FamilyMember:
    """Which completion of a request added with SamplingParams.n > 1 this one is
    (engine/parallel_sampling.py): completion `index` of `parent_req_id`, whose first
    completion has that req_id. A request with n = 1 is completion 0 of itself."""
    index: int
    parent_req_id: str


@dataclass
class PrefillClocks:
    """Where the request stands in srpt's prefill order (engine/core/prefill_order.py),
    on the scheduler's work clock (prompt tokens it has scheduled)."""
    # the aging origin: the clock when this request arrived, moved on by each chunk of its
    # own, so that the clock's lead over it is the prompt work done for other requests meanwhile
    aging: int = 0
    # its TTFT budget as a clock reading (prefill_order.keep_deadline); None: no deadline kept
    deadline: int | None = None
    latest_start: int = 0


@dataclass
class DraftState:
    """Speculative decoding: this step's draft tokens, proposed before scheduling, and the
    verifications in a row that kept no draft and steps left without proposing: a request
    whose text the proposer cannot guess stops paying for verification (spec_decode/drafting.py)."""
    token_ids: list[int] = field(default_factory=list)
    misses: int = 0
    pause: int = 0


class Request:
    """A request inside the engine core: what the caller asked (`entry`, an EngineRequest,
    with this completion's own req_id and SamplingParams when n > 1), its tokens, progress
    and status, and each feature's state in a named part."""

    def __init__(self, entry: EngineRequest, eos_token_ids: frozenset[int] = frozenset(),
                 family: FamilyMember | None = None, arrival_time: float | None = None):
        self.entry = entry
        self.req_id = entry.req_id
        self.prompt_token_ids = list(entry.prompt_token_ids)
        self.sampling_params = entry.params
        self.mode = entry.mode
        self.slo = entry.slo
        self.eos_token_ids = eos_token_ids
        self.family = family if family is not None else FamilyMember(0, entry.req_id)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = self.prompt_token_ids + list(entry.output_token_ids)
        # KV computed elsewhere for the first kv_import.num_tokens tokens, loaded on admission
        self.kv_import = entry.kv_import
        self.first_scheduled_time: float | None = None
        self.clocks = PrefillClocks()
        # when it had its first tokens: those given (a decode-only or resumed request) on
        # arrival, else its first one here (engine/core/tpot_room.py)
        self.tpot_anchor: tuple[float, int] | None = (
            (self.arrival_time, len(entry.output_token_ids)) if entry.output_token_ids else None)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        # vLLM's rule: a request that wants its prompt's logprobs computes every prompt token,
        # so it reads no cached prefix (its own blocks are still cached for others)
        self.skip_reading_prefix_cache = entry.params.prompt_logprobs is not None
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        # structured outputs: the matcher (engine/structured), once the grammar is compiled
        self.grammar = None
        self.draft = DraftState()

    @property
    def priority(self) -> int:
        """Lower is more urgent; FCFS within a priority."""
        return self.entry.priority

    @property
    def prefill_chunk_tokens(self) -> int:
        """At most this many prompt tokens a step; 0: no cap."""
        return self.entry.prefill_chunk_tokens

    @property
    def cache_salt(self) -> str:
        """Mixed into the first block hash: only requests with the same salt share cached KV."""
        return self.entry.cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.tpot_anchor is None:
            self.tpot_anchor = (time.monotonic(), self.num_output_tokens)
