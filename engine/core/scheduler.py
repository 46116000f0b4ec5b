"""V1-style scheduler: one token budget per step, decodes and prefills mixed.

Pure Python, no torch. Every request simply has `num_computed_tokens` and `num_tokens`;
each step gives it up to `num_tokens - num_computed_tokens` more, so a decode (1 token),
a prefill chunk and a resumed preempted request are all the same thing.

    prompt:  [==========computed==========|--chunk this step--|.....rest.....]
                                          ^num_computed       ^+num_new

With chunked prefill off the rest is never split: it runs whole or waits for a step
whose budget holds it (the engine ensures a full budget holds any request).

    prompt:  [===computed===|---------------all of it this step---------------]

A step's budget is tokens (max_num_batched_tokens, a chunk at most
long_prefill_token_threshold) and, with max_step_ms, time: its prompt tokens are what the
measured prefill rate computes in that time beside the step's decodes, at least one block.
A step without decodes may last longer when the TTFT targets of the traffic allow it
(engine/core/step_bound.py).
Which prefill work comes first is the order's (engine/core/prefill_order.py): fcfs, or
srpt, where a short prompt arriving behind a long one's chunks joins the next step.

The siblings of an n > 1 request (engine/parallel_sampling.py) are passed over in the
queue until the first's allocation covers the prompt's full blocks; then they hit them:

    first:    [ block 0 ][ block 1 ][ tail ]   chunks of one block: steps 1, 2, 3
    sibling:  [   hit   ][   hit   ][ tail ]   queued in step 1; admitted in step 2, once
                                               block 1 is allocated (written in that step
                                               before any attention reads it)
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_transfer import KVLoad
from pdserve.engine.core.scheduler_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                                  SchedulerOutput)
from pdserve.engine.core.prefill_order import is_decode, prefill_order, summarize_queue
from pdserve.engine.core.step_bound import StepBound
from pdserve.engine.parallel_sampling import waits_for_sibling
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.stats import QueuedPrefill
from pdserve.engine.step_rates import MIN_PREFILL_TOKENS_FOR_RATE, StepRates


@dataclass
class StepBudget:
    """What is left of one step: its tokens (max_num_batched_tokens) and, within them, its
    prompt tokens (max_step_ms at the measured rate; the same as the tokens without it)."""
    num_tokens: int
    num_prefill_tokens: int
    # what is left of the room the requests asking for small chunks share (None: none of
    # them scheduled yet this step): their caps size the step, not each request
    num_capped_prefill_tokens: int | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, rates: StepRates | None = None,
                 step_bound: StepBound | None = None):
        """`rates`: the engine's measured step costs, read for max_step_ms (the engine
        updates them after each step); None: never measured, so token budgets only.
        `step_bound`: how long a step may last (default: max_step_ms, lengthened for
        prompts alone by the TTFT targets of the requests, on the wall clock)."""
        self.config = config
        self.kv = kv_cache_manager
        self.rates = rates if rates is not None else StepRates()
        self.step_bound = step_bound if step_bound is not None else StepBound(config.max_step_ms)
        self.order = prefill_order(config.scheduling_policy)
        self.clock = 0  # prompt tokens scheduled since start: srpt's work clock
        self._admitted_now: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0

    # ---- queue management ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue behind every waiting request of the same or a more urgent priority."""
        self.requests[request.req_id] = request
        request.clocks.aging = self.clock
        self.step_bound.note_arrival(request.slo.min_class_ttft_s)
        self.order.on_arrival(request, self.clock, self.rates, self.step_ms())
        if not self.waiting or self.waiting[-1].priority <= request.priority:
            self.waiting.append(request)
            return
        index = next((i for i, r in enumerate(self.waiting)
                      if r.priority > request.priority and r.status != RequestStatus.PREEMPTED),
                     len(self.waiting))
        self.waiting.insert(index, request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Two passes over one budget: the running requests the order takes first (fcfs: all
        of them; srpt: the decodes), then the prefill candidates in the order's sequence."""
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        self._admitted_now = set()
        budget = self._step_budget()
        self._schedule_running(out, budget)
        self._schedule_prefills(out, budget)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.finished_req_ids |= out.preempted_req_ids
        out.kv_offloads, out.kv_onloads = self.kv.take_host_copies()
        return out

    def _step_budget(self) -> StepBudget:
        """This step's tokens, and within them its prompt tokens: with max_step_ms, what the
        measured prefill rate computes in that time beside this step's decodes (their
        measured step time taken off), never less than one block; until a rate is measured,
        and without max_step_ms, the token budget alone.

        Beside decodes, never less than the smallest prefill StepRates measures either: a
        rate once measured too low (a slow first step) would otherwise size every chunk
        below it, and so never be measured again."""
        num_tokens = self.config.max_num_batched_tokens
        if not self.config.max_step_ms or self.rates.prefill_tokens_per_s <= 0:
            return StepBudget(num_tokens, num_tokens)
        with_decodes = self._with_decodes()
        within = self.rates.prefill_tokens_within(self.step_bound.step_ms(with_decodes) / 1000, with_decodes)
        floor = max(self.kv.block_size, MIN_PREFILL_TOKENS_FOR_RATE if with_decodes else 0)
        return StepBudget(num_tokens, min(num_tokens, max(floor, within)))

    def step_ms(self) -> float:
        """The bound of the next step as the running requests stand (0: tokens only): what a
        prompt arriving now waits for at most before it can join."""
        return self.step_bound.step_ms(self._with_decodes())

    def _with_decodes(self) -> bool:
        return any(is_decode(r) for r in self.running)

    def _num_new_tokens(self, request: Request, num_computed: int, budget: StepBudget) -> int:
        """Tokens to compute this step; 0 when chunked prefill is off and the rest does not fit.
        A request may ask for smaller chunks than the engine's (a router sizing a prefill
        to the ITL budget of the streams it joins). That budget is the step's: the requests
        asking for it share it, so two prompts sent to one worker make its steps no longer
        than one would."""
        remaining = request.num_tokens - num_computed
        room = budget.num_tokens if remaining == 1 else min(budget.num_tokens, budget.num_prefill_tokens)
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= room else 0
        chunk = self.config.long_prefill_token_threshold
        if request.prefill_chunk_tokens:
            chunk = min(chunk, _capped_room(request, budget))
        return max(0, min(remaining, chunk, room))

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
        i = 0
        while i < len(self.running) and budget.num_tokens > 0:
            request = self.running[i]
            if self.order.runs_first(request) and not self._schedule_one_running(request, out, budget):
                break
            i += 1

    def _schedule_one_running(self, request: Request, out: SchedulerOutput, budget: StepBudget) -> bool:
        """Its next tokens, preempting the latest admitted for blocks when they run out (never
        one admitted in this very step: the request then waits a step instead). False when
        it had to give up its own blocks: nothing more runs this step."""
        num_new = self._num_new_tokens(request, request.num_computed_tokens, budget)
        if num_new == 0:  # does not fit unsplit: it waits, the decodes behind it need not
            return True
        # drafts ride along a decode, within the budget; they never start a prefix-cache entry
        drafts, request.draft.token_ids = request.draft.token_ids, []
        if not is_decode(request):
            drafts = []
        drafts = drafts[:budget.num_tokens - num_new]
        self.kv.free_outside_window(request)
        num_kept = self.kv.num_blocks(request.req_id)
        new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts))
        while new_blocks is None:
            if self.running[-1].req_id in self._admitted_now:
                return True
            victim = self.running.pop()  # lowest priority: the latest admitted
            self._preempt(victim, out)
            if victim is request:
                return False
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=len(drafts))
        out.scheduled_cached_reqs.append(CachedRequestData(
            request.req_id, [b.block_id for b in new_blocks], request.num_computed_tokens, num_kept))
        if drafts:
            out.spec_token_ids[request.req_id] = drafts
        self._advance(request, num_new + len(drafts), out, budget)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go to the queue's front."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_req_ids.add(request.req_id)
        out.num_scheduled_tokens.pop(request.req_id, None)
        out.scheduled_cached_reqs = [c for c in out.scheduled_cached_reqs if c.req_id != request.req_id]
        out.spec_token_ids.pop(request.req_id, None)
        request.draft.token_ids = []

    def _schedule_prefills(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """The running requests the first pass left, and the waiting ones, in the order's
        sequence. Admissions stop at the first that cannot be admitted (and after a
        preemption); running prompts behind it still get their chunks.

            srpt, budget 8, a 40-token prompt L running and a 6-token S just arrived:
                step k:    [ L 8 ]                      (S not there yet)
                step k+1:  [ S 6 ][ L 2 ]               S ranks first: it joins at once
                step k+2:  [ L 8 ]
        """
        rest = [r for r in self.running if not self.order.runs_first(r)]
        admitting = True
        for request in self.order.order(rest, self.waiting, self.clock):
            if budget.num_tokens <= 0 or budget.num_prefill_tokens <= 0:
                break
            if request.status == RequestStatus.RUNNING:
                if not self._schedule_one_running(request, out, budget):
                    break
            elif admitting and not out.preempted_req_ids:
                admitting = self._admit(request, out, budget)

    def _admit(self, request: Request, out: SchedulerOutput, budget: StepBudget) -> bool:
        """Its first chunk (after prefix hits and imported KV); False when it cannot be
        admitted, and so nothing after it is this step."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        # n > 1: siblings stay queued until their first has the prompt's blocks; passed over,
        # since the first progresses among the running and the rest of the queue need not wait
        if self.kv.enable_prefix_caching and waits_for_sibling(request, self.requests.get(request.family.parent_req_id),
                                                               self.kv.block_size):
            return True
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        num_loaded = self._num_loaded(request, num_hit_tokens)
        num_computed = num_hit_tokens + num_loaded
        num_new = self._num_new_tokens(request, num_computed, budget)
        if num_new == 0 and request.prefill_chunk_tokens and budget.num_capped_prefill_tokens == 0:
            return True  # the shared room went to others this step; the rest of the queue need not wait
        if num_new == 0:  # waits at the head: skipping it would starve long prompts
            return False
        new_blocks = self.kv.allocate_slots(request, num_loaded + num_new, hits)
        if new_blocks is None:
            return False
        self.waiting.remove(request)
        kv_load = self._take_kv_load(request, num_hit_tokens, num_loaded)
        request.num_computed_tokens = num_computed
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        if request.num_cached_tokens < 0:  # first admission, not a resume
            request.num_cached_tokens = num_computed  # reused, locally or imported
            self.kv.count_lookup(request, hits)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._admitted_now.add(request.req_id)
        out.scheduled_new_reqs.append(NewRequestData(
            request.req_id, list(request.all_token_ids), request.sampling_params,
            self.kv.get_block_ids(request.req_id), num_computed, kv_load, request.num_prompt_tokens))
        self._advance(request, num_new, out, budget)
        return True

    def _num_loaded(self, request: Request, num_hit_tokens: int) -> int:
        """Imported tokens past the local prefix hits. A payload that starts past them (its
        reader counted on local blocks evicted since) leaves a gap: nothing of it is used."""
        payload = request.kv_import
        if payload is None or payload.first_block * self.kv.block_size > num_hit_tokens:
            return 0
        return max(0, payload.num_tokens - num_hit_tokens)

    def _take_kv_load(self, request: Request, num_hit_tokens: int, num_loaded: int) -> KVLoad | None:
        """The imported blocks not already covered by local prefix hits; the payload is
        dropped afterwards (a later preemption recomputes instead).

            payload:  [b0][b1][b2][b3 tail]
            local:    [b0][b1]                  <- prefix hits, kept
            loaded:           [b2][b3 tail]     <- written into newly allocated blocks
        """
        payload, request.kv_import = request.kv_import, None
        if not num_loaded:
            return None
        bs = self.kv.block_size
        first, end = num_hit_tokens // bs, -(-(num_hit_tokens + num_loaded) // bs)
        block_ids = self.kv.get_block_ids(request.req_id)[first:end]
        return KVLoad(block_ids, payload.blocks[first - payload.first_block:end - payload.first_block])

    def _advance(self, request: Request, num_new: int, out: SchedulerOutput, budget: StepBudget) -> None:
        out.num_scheduled_tokens[request.req_id] = num_new
        if not is_decode(request):  # a prompt chunk: it moves srpt's work clock, the request's own with it
            budget.num_prefill_tokens -= num_new
            if request.prefill_chunk_tokens:
                budget.num_capped_prefill_tokens = max(0, _capped_room(request, budget) - num_new)
            self.clock += num_new
            request.clocks.aging += num_new
        budget.num_tokens -= num_new
        request.num_computed_tokens += num_new

    # ---- results ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[tuple[Request, list[int]]]:
        """The requests that got tokens this step, with them, for the caller to append one
        at a time (a stop may come before the last). Rejected drafts are rolled back here:
        the computed length drops to the tokens the step kept, and blocks only the
        rejected drafts used go back to the pool.

            scored:  [last][d1][d2][d3]   accepted d1, then the target's t:  tokens [d1, t]
            KV kept: [last][d1]           computed = num_tokens - 1 once they are appended
        """
        updated = []
        for req_id, token_ids in result.sampled_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            drafts = out.spec_token_ids.get(req_id)
            if drafts is not None:
                request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
                self.kv.trim(request)
            updated.append((request, token_ids))
        return updated

    def check_stop(self, request: Request) -> RequestStatus | None:
        """Stop conditions on token ids; stop strings are checked by the output processor."""
        params = request.sampling_params
        last = request.all_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: the prefill work ahead of a new request."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + sum(
            r.num_tokens - r.num_computed_tokens for r in self.running if r.num_tokens - r.num_computed_tokens > 1)

    def queued_prefill(self) -> tuple[QueuedPrefill, ...]:
        """That work by priority and rank bucket, as this scheduler's order ranks it against a
        newcomer (the load report: the router estimates a new request's wait from it)."""
        return summarize_queue([*self.waiting, *self.running], self.order, self.clock)


def _capped_room(request: Request, budget: StepBudget) -> int:
    """What a request asking for small chunks may take this step: its own cap, within what
    the others asking for one left."""
    if budget.num_capped_prefill_tokens is None:
        return request.prefill_chunk_tokens
    return min(request.prefill_chunk_tokens, budget.num_capped_prefill_tokens)
