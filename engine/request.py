"""A request's life inside the engine core: tokens, progress, status."""
from __future__ import annotations

import enum
import time

from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.sampling_params import SamplingParams


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


class Request:
    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), arrival_time: float | None = None,
                 output_token_ids: list[int] = (), kv_import: KVPayload | None = None,
                 mode: RequestMode = RequestMode.COLOCATED, priority: int = 0, prefill_chunk_tokens: int = 0,
                 cache_salt: str = "", index: int = 0, parent_req_id: str | None = None,
                 ttft_budget_s: float = 0.0, itl_target_s: float = 0.0, min_class_ttft_s: float = 0.0):
        self.req_id = req_id
        # SamplingParams.n > 1: completion `index` of the request added as `parent_req_id`,
        # whose first completion has that req_id (engine/parallel_sampling.py); n = 1: 0, req_id
        self.index = index
        self.parent_req_id = req_id if parent_req_id is None else parent_req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids) + list(output_token_ids)
        # KV computed elsewhere for the first kv_import.num_tokens tokens, loaded on admission
        self.kv_import = kv_import
        self.mode = mode
        self.priority = priority  # lower is more urgent; FCFS within a priority
        self.prefill_chunk_tokens = prefill_chunk_tokens  # at most this many prompt tokens a step; 0: no cap
        self.first_scheduled_time: float | None = None
        # srpt's aging origin: the scheduler's work clock (prompt tokens it has scheduled) when
        # this request arrived, moved on by each chunk of its own, so that the clock's lead
        # over it is the prompt work done for other requests meanwhile
        self.aging_clock = 0
        # the time left to its first token when it was sent (a prefill worker's request: the
        # router's class target less the time already spent); 0: none. srpt turns it into
        # `deadline_clock` (prefill_order.keep_deadline); None: no deadline kept
        self.ttft_budget_s = ttft_budget_s
        # the tightest TTFT target of its router's SLO classes (0: none): what a newcomer
        # may need, so how long steps may last (engine/core/step_bound.py)
        self.min_class_ttft_s = min_class_ttft_s
        self.deadline_clock: int | None = None
        self.latest_start_clock = 0
        # the mean inter-token time its stream keeps (the router's class target; 0: none), and
        # when it had its first tokens: those given (a decode-only or resumed request) on
        # arrival, else its first one here (engine/core/tpot_room.py)
        self.itl_target_s = itl_target_s
        self.tpot_anchor: tuple[float, int] | None = (
            (self.arrival_time, len(output_token_ids)) if len(output_token_ids) else None)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        # mixed into the first block hash: only requests with the same salt share cached KV
        self.cache_salt = cache_salt
        # vLLM's rule: a request that wants its prompt's logprobs computes every prompt token,
        # so it reads no cached prefix (its own blocks are still cached for others)
        self.skip_reading_prefix_cache = sampling_params.prompt_logprobs is not None
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        # structured outputs: the matcher (engine/structured), once the grammar is compiled
        self.grammar = None
        # speculative decoding: this step's draft tokens, proposed before scheduling
        self.spec_token_ids: list[int] = []
        # verifications in a row that kept no draft, and steps left without proposing: a
        # request whose text the proposer cannot guess stops paying for verification
        self.spec_misses = 0
        self.spec_pause = 0

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
