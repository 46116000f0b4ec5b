"""Which path a request takes: prefilled by the prefill pool and handed over through the
kvstore (disaggregated), or prefilled by the decode worker that will stream it (direct).

    adaptive (default)  decided per request from the workers' measured rates and load:
                        the cheapest path that keeps both targets, the running streams'
                        ITL and the new request's TTFT
    threshold           a fixed prompt length: short prompts direct, the rest through the pool
    colocated           no prefill pool: every decode worker prefills its own prompts

A worker of both roles (`pdserve decode --role both`) is listed in both pools. A prompt is
never handed over through the kvstore from a worker to itself: the prefill pool's path is
estimated over the prefill workers other than the decode worker it assumes, and when the
only prefill worker is that decode worker the prompt goes direct ("same_worker"). A
disaggregated choice names that decode worker (`decode_address`): the flow keeps the
prompt's prefill off it, and the decode off the worker that prefilled.

Each choice carries a reason; the router counts requests by (path, reason).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.core.prefill_order import rank_on_arrival
from pdserve.engine.step_rates import MIN_PREFILL_TOKENS_FOR_RATE, StepRates
# PATH_POLICIES: the flags' choices, found here beside the policies they name
from pdserve.services.router.decide.config import PATH_POLICIES, PathConfig, RoutingConfig, SLOClass  # noqa: F401
from pdserve.services.router.decide.policy import MostRoomDecode
from pdserve.services.router.decide.saturation import decode_prefill_backlog, prefill_backlog, prefill_work_ahead
from pdserve.services.router.decide.views import WorkerView

DIRECT = "direct"                  # a decode worker prefills the prompt itself
DISAGGREGATED = "disaggregated"    # prefill pool -> kvstore -> decode pool
# the pool the request would have used is down: a decode worker prefills it (counted as a fallback)
NO_PREFILL_WORKER = "no_prefill_worker"
# the kvstore is down: a prefill's KV could not reach the decode worker, which would
# compute the prompt a second time; it prefills it once, directly
KVSTORE_DOWN = "kvstore_down"
# the only prefill worker is the decode worker itself (a worker of both roles): it prefills
# the prompt directly rather than handing its KV over to itself through the kvstore
SAME_WORKER = "same_worker"
# a client resumes a stream its router lost (GenerateRequest.resume_token_ids): a decode worker
# computes the prompt and the tokens the client has, and goes on (core/flow.py)
RESUMED = "resumed"


# the share of the streams' ITL room a direct prompt's chunks take when it runs for more than
# one step: its steps then set the streams' mean inter-token time (their TPOT), not one gap,
# and prompts sent one after another keep the worker's steps full. At the whole room that mean
# sits on the target and every misestimate (a chunk late in a long prompt costs more than its
# first) breaks it: the 10% mix at 3.5 req/s lost 9-16% of its requests to TPOTs of
# 150-190 ms against a 150 ms target (docs/benchmarks_history.md, issue 33's fourth
# sitting). Half keeps the mean halfway between a step and the target. A prompt that fits
# one step's room takes the whole of it: one gap at the target, once.
DIRECT_ROOM_SHARE = 0.5
# the share of the decode worker's TPOT room (WorkerLoad.tpot_stall_room_ms) a rescued
# prompt's prefill may take: the room counts each stream's tokens up to max_tokens, and a
# stream that stops sooner keeps its mean over fewer gaps; the steps also lengthen as the
# batch grows. Half leaves both their margin.
TPOT_ROOM_SHARE = 0.5


@dataclass(frozen=True)
class PathChoice:
    path: str        # DIRECT or DISAGGREGATED
    reason: str      # why; a metric label, so one of a few fixed words
    prefill_chunk_tokens: int = 0  # direct path: the most prompt tokens per step (0: the worker's own)
    # disaggregated: the decode worker the estimate assumed, which the prefill then avoids
    # ("": a policy that assumed none)
    decode_address: str = ""


@dataclass(frozen=True)
class PoolsNow:
    """The workers a decision may use, as last polled (up ones only)."""
    prefill: Sequence[WorkerView]
    decode: Sequence[WorkerView]
    kvstore_up: bool = True


class PathPolicy(ABC):
    colocated: bool = False

    @abstractmethod
    def choose(self, num_prompt_tokens: int, slo_class: str, pools: PoolsNow) -> PathChoice:
        ...


class ColocatedPaths(PathPolicy):
    colocated = True

    def choose(self, num_prompt_tokens, slo_class, pools):
        return PathChoice(DIRECT, "colocated")


class ThresholdPaths(PathPolicy):
    """Short prompts go straight to a decode worker: their prefill costs less than moving
    their KV. A class may set its own threshold (0: always through the prefill pool)."""

    def __init__(self, short_prompt_tokens: int, slo_classes: dict[str, SLOClass]):
        self._default = short_prompt_tokens
        self._per_class = {name: c.short_prompt_tokens for name, c in slo_classes.items()
                           if c.short_prompt_tokens is not None}

    def choose(self, num_prompt_tokens, slo_class, pools):
        limit = self._per_class.get(slo_class, self._default)
        if num_prompt_tokens <= limit:
            return PathChoice(DIRECT, "short_prompt")
        decode = MostRoomDecode().choose(pools.decode)
        return (_pool_unusable(pools, decode) or
                PathChoice(DISAGGREGATED, "long_prompt", decode_address=decode.address if decode else ""))


class AdaptivePaths(PathPolicy):
    """Estimates from what the workers measure (GetLoad's prefill tokens/s and decode step
    time; PathConfig's guesses until a worker has measured), in this order:

    1. direct when the decode worker's running streams absorb the prefill within one step
       of the strictest ITL target: nothing to move, nobody waits;
    2. else the path with the earlier first token, where the direct path is allowed only
       for a prompt whose whole prefill stalls the decode worker's streams by at most
       `max_direct_stall_itls` ITL targets, runs in chunks of half the room that a step
       leaves under the target (DIRECT_ROOM_SHARE), and pays for that stall in the comparison:

           prefill pool:  step in flight + (work ahead + prompt) / pool rate + hand-off
           direct:        decode backlog / rate + steps x step + stall, where steps are
                          the chunks of the decode backlog and the prompt

       where the decode backlog is the prompt tokens it has yet to compute (its report and
       what this router sent since), not the prompts of streams it already decodes, and
       the work ahead is what the prefill worker's own order (WorkerLoad.queued_prefill)
       puts before this request: under srpt, of its class, only what ranks below its length,
       so a short prompt behind long ones waits one step (max_step_ms), not their backlog.
       Short prompts go through the prefill pool unless it is busy with work that goes
       first; long prompts take the pool (the isolation the pools exist for)...
    3. ...unless the pool's estimate misses the request's own TTFT target and the decode
       worker meets it in chunks of the same size, after the prompts queued there
       ("prefill_pool_misses_ttft"): a first token the operator's SLO would count as
       lost is not bought with a decode core that has room. The running streams keep their
       targets; they lose part of the margin under them (the isolation benchmark's
       calm-to-burst ratio), and only while the pool is behind. When the streams' TPOT
       room (WorkerLoad.tpot_stall_room_ms) takes the whole prefill, the prompt runs in
       steps of up to rescue_step_ms: a pause their mean absorbs, not a crawl.
    """

    def __init__(self, cfg: PathConfig, slo_classes: dict[str, SLOClass]):
        self.cfg = cfg
        self.slo_classes = slo_classes
        self._strictest_itl_s = min(c.itl_ms for c in slo_classes.values()) / 1000

    def choose(self, num_prompt_tokens, slo_class, pools):
        if not pools.decode:  # the flow fails the request: no prefill for it
            return PathChoice(DIRECT, "no_decode_worker")
        n, cfg = num_prompt_tokens, self.cfg
        # the worker the decode placement picks when no prefix tips it: the one with most room
        decode = MostRoomDecode().choose(pools.decode)
        step_s = (decode.decode_step_ms or cfg.default_decode_step_ms) / 1000
        rate = self._rate(decode, pools)
        backlog = decode_prefill_backlog(decode)
        room_s = max(0.0, self._strictest_itl_s - step_s)
        if (backlog + n) / rate <= room_s:
            return PathChoice(DIRECT, "fits_itl_budget")
        # same_worker too goes without a chunk size: a long prompt in chunks sized to an ITL
        # budget already spent would crawl; the worker's own --max-step-ms bounds its steps
        unusable = _pool_unusable(pools, decode)
        if unusable is not None:
            return unusable
        slo = self.slo_classes[slo_class]
        pool_ttft_s = min(self._prefill_ttft_s(w, n, slo, pools) for w in _handoff_prefills(pools, decode))
        stall_s = n / rate
        if stall_s <= cfg.max_direct_stall_itls * self._strictest_itl_s:
            chunk = self._direct_chunk(room_s, rate)
            if self._direct_ttft_s(n, rate, step_s, backlog, chunk) + stall_s < pool_ttft_s:
                return PathChoice(DIRECT, "prefill_pool_busy", prefill_chunk_tokens=chunk if chunk < n else 0)
        ttft_target_s = slo.ttft_ms / 1000
        if pool_ttft_s <= ttft_target_s:
            return PathChoice(DISAGGREGATED, "prefill_pool", decode_address=decode.address)
        rescue = self._rescue(n, rate, step_s, room_s, backlog, ttft_target_s, decode.tpot_stall_room_ms / 1000)
        return rescue or PathChoice(DISAGGREGATED, "prefill_pool_backlogged", decode_address=decode.address)

    def _rescue(self, n: int, rate: float, step_s: float, room_s: float, backlog: int,
                ttft_target_s: float, tpot_room_s: float) -> PathChoice | None:
        """The prefill pool would miss the request's TTFT target: the decode worker takes
        the prompt, whatever its length, if it meets the target after the prompts queued
        there, whose chunks share the same room per step (the engine's rule): rule 2's
        estimate. The chunks are half its streams' ITL room (DIRECT_ROOM_SHARE), unless
        their TPOT room takes the whole prefill, the queued prompts' with it, within
        TPOT_ROOM_SHARE of it: then steps of up to rescue_step_ms, a pause the streams'
        mean absorbs instead of a crawl that makes the prompt late. The chunk is always
        given, so a prompt sent there later does not lengthen its steps either."""
        chunk = self._direct_chunk(room_s, rate)
        reason = "prefill_pool_misses_ttft"
        # inf: no stream keeps a target there now, and those that join while the prompt
        # runs would see its long steps for all their tokens: the ITL room's chunks
        if math.isfinite(tpot_room_s) and (backlog + n) / rate <= TPOT_ROOM_SHARE * tpot_room_s:
            paused = int(self.cfg.rescue_step_ms / 1000 * rate)
            if paused > chunk:
                chunk, reason = paused, "prefill_pool_misses_ttft_tpot_room"
        if self._direct_ttft_s(n, rate, step_s, backlog, chunk) > ttft_target_s:
            return None
        return PathChoice(DIRECT, reason, prefill_chunk_tokens=chunk)

    @staticmethod
    def _direct_ttft_s(n: int, rate: float, step_s: float, backlog: int, chunk: int) -> float:
        """The first token on the decode worker: its queued prompt tokens and this prompt
        computed at its rate, plus a decode step for each chunk of them (they share one
        step's room, so each chunk costs a step)."""
        return (backlog + n) / rate + -(-(backlog + n) // chunk) * step_s

    def _direct_chunk(self, room_s: float, rate: float) -> int:
        """Prompt tokens per step for a direct prompt of several chunks: DIRECT_ROOM_SHARE
        of the room a step leaves under the ITL target, at least min_direct_chunk_tokens."""
        return max(self.cfg.min_direct_chunk_tokens, int(DIRECT_ROOM_SHARE * room_s * rate))

    def _prefill_ttft_s(self, w: WorkerView, n: int, slo: SLOClass, pools: PoolsNow) -> float:
        """The worker's own rule: the step in flight, which the request cannot join (at most
        the worker's max_step_ms, and no longer than its backlog takes: none when it is
        idle), then the work its order puts ahead of the request (ranked as the worker
        will rank it, its TTFT target its deadline), then its own prompt."""
        rate = prefill_rate_beside_decodes(w, self._rate(w, pools))
        in_flight_s = min(w.max_step_ms / 1000, prefill_backlog(w) / rate)
        rank = rank_on_arrival(n, slo.ttft_ms / 1000, rate, w.max_step_ms)
        return in_flight_s + (prefill_work_ahead(w, slo.priority, rank) + n) / rate + self.cfg.kv_handoff_ms / 1000

    def _rate(self, w: WorkerView, pools: PoolsNow) -> float:
        """The worker's measured prefill rate; before it has one, the best any worker has
        measured (same hardware, most likely), else the configured guess."""
        if w.prefill_tokens_per_s > 0:
            return w.prefill_tokens_per_s
        measured = [v.prefill_tokens_per_s for v in (*pools.prefill, *pools.decode) if v.prefill_tokens_per_s > 0]
        return max(measured, default=self.cfg.default_prefill_tokens_per_s)


def prefill_rate_beside_decodes(w: WorkerView, rate: float) -> float:
    """The prompt tokens per second a worker computes for others while it also decodes (a
    worker of both roles): each step is its decode batch plus what its step bound leaves
    for prompts (the engine's own rule, StepRates.prefill_tokens_within, never under the
    scheduler's floor). A prefill worker, which never measures a decode step, or a worker
    without a step bound: `rate` as it is."""
    if not (w.num_running and w.decode_step_ms > 0 and w.max_step_ms > 0):
        return rate
    decode_s = w.decode_step_ms / 1000
    tokens = max(MIN_PREFILL_TOKENS_FOR_RATE, StepRates(decode_s, rate).prefill_tokens_within(
        w.max_step_ms / 1000, with_decodes=True))
    return tokens / (decode_s + tokens / rate)


def _handoff_prefills(pools: PoolsNow, decode: WorkerView | None) -> list[WorkerView]:
    """The prefill workers that can hand a prompt over to `decode`: all but itself."""
    return [w for w in pools.prefill if decode is None or w.address != decode.address]


def _pool_unusable(pools: PoolsNow, decode: WorkerView | None) -> PathChoice | None:
    """The direct path when the prefill pool's path cannot be taken, and why."""
    if not pools.prefill:
        return PathChoice(DIRECT, NO_PREFILL_WORKER)
    if not pools.kvstore_up:
        return PathChoice(DIRECT, KVSTORE_DOWN)
    if not _handoff_prefills(pools, decode):
        return PathChoice(DIRECT, SAME_WORKER)
    return None


def path_policy(cfg: RoutingConfig, colocated: bool) -> PathPolicy:
    """`colocated`: the router was given no prefill pool at all (not one that is down)."""
    if colocated or cfg.paths.policy == "colocated":
        return ColocatedPaths()
    if cfg.paths.policy == "threshold":
        return ThresholdPaths(cfg.short_prompt_tokens, cfg.slo_classes)
    return AdaptivePaths(cfg.paths, cfg.slo_classes)
