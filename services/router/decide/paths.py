"""Which path a request takes: prefilled by the prefill pool and handed over through the
kvstore (disaggregated), or prefilled by the decode worker that will stream it (direct).

    adaptive (default)  decided per request from the workers' measured rates and load:
                        the cheapest path that keeps both targets, the running streams'
                        ITL and the new request's TTFT
    threshold           a fixed prompt length: short prompts direct, the rest through the pool
    colocated           no prefill pool: every decode worker prefills its own prompts

Each choice carries a reason; the router counts requests by (path, reason).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

# PATH_POLICIES: the flags' choices, found here beside the policies they name
from services.router.decide.config import PATH_POLICIES, PathConfig, RoutingConfig, SLOClass  # noqa: F401
from services.router.decide.policy import MostRoomDecode
from services.router.decide.saturation import prefill_backlog, prefill_work_ahead
from services.router.decide.views import WorkerView
DIRECT = "direct"                  # a decode worker prefills the prompt itself
DISAGGREGATED = "disaggregated"    # prefill pool -> kvstore -> decode pool
# the pool the request would have used is down: a decode worker prefills it (counted as a fallback)
NO_PREFILL_WORKER = "no_prefill_worker"
# the kvstore is down: a prefill's KV could not reach the decode worker, which would
# compute the prompt a second time; it prefills it once, directly
KVSTORE_DOWN = "kvstore_down"


@dataclass(frozen=True)
class PathChoice:
    path: str        # DIRECT or DISAGGREGATED
    reason: str      # why; a metric label, so one of a few fixed words
    prefill_chunk_tokens: int = 0  # direct path: the most prompt tokens per step (0: the worker's own)


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
        return _pool_unusable(pools) or PathChoice(DISAGGREGATED, "long_prompt")


class AdaptivePaths(PathPolicy):
    """Estimates from what the workers measure (GetLoad's prefill tokens/s and decode step
    time; PathConfig's guesses until a worker has measured), in this order:

    1. direct when the decode worker's running streams absorb the prefill within one step
       of the strictest ITL target: nothing to move, nobody waits;
    2. else the path with the earlier first token, where the direct path is allowed only
       for a prompt whose whole prefill stalls the decode worker's streams by at most
       `max_direct_stall_itls` ITL targets, runs in chunks that keep each step near the
       target, and pays for that stall in the comparison:

           prefill pool:  step in flight + (work ahead + prompt) / pool rate + hand-off
           direct:        decode backlog / rate + steps x (step + chunk / rate) + stall

       where the work ahead is what the prefill worker's own order (WorkerLoad.queued_prefill)
       puts before this request: under srpt, of its class, only what ranks below its length,
       so a short prompt behind long ones waits one step (max_step_ms), not their backlog.
       Short prompts go through the prefill pool unless it is busy with work that goes
       first; long prompts always take the pool (the isolation the pools exist for).
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
        backlog = prefill_backlog(decode)
        room_s = max(0.0, self._strictest_itl_s - step_s)
        if (backlog + n) / rate <= room_s:
            return PathChoice(DIRECT, "fits_itl_budget")
        unusable = _pool_unusable(pools)
        if unusable is not None:
            return unusable
        priority = self.slo_classes[slo_class].priority
        pool_ttft_s = min(self._prefill_ttft_s(w, n, priority, pools) for w in pools.prefill)
        stall_s = n / rate
        if stall_s <= cfg.max_direct_stall_itls * self._strictest_itl_s:
            chunk = max(cfg.min_direct_chunk_tokens, int(room_s * rate))
            steps = -(-n // chunk)
            direct_ttft_s = backlog / rate + steps * step_s + stall_s
            if direct_ttft_s + stall_s < pool_ttft_s:
                return PathChoice(DIRECT, "prefill_pool_busy", prefill_chunk_tokens=chunk if chunk < n else 0)
        if pool_ttft_s <= self.slo_classes[slo_class].ttft_ms / 1000:
            return PathChoice(DISAGGREGATED, "prefill_pool")
        return PathChoice(DISAGGREGATED, "prefill_pool_backlogged")

    def _prefill_ttft_s(self, w: WorkerView, n: int, priority: int, pools: PoolsNow) -> float:
        """The worker's own rule: the step in flight, which the request cannot join (at most
        the worker's max_step_ms, and no longer than its backlog takes: none when it is
        idle), then the work its order puts ahead of the request, then its own prompt."""
        rate = self._rate(w, pools)
        in_flight_s = min(w.max_step_ms / 1000, prefill_backlog(w) / rate)
        return in_flight_s + (prefill_work_ahead(w, priority, n) + n) / rate + self.cfg.kv_handoff_ms / 1000

    def _rate(self, w: WorkerView, pools: PoolsNow) -> float:
        """The worker's measured prefill rate; before it has one, the best any worker has
        measured (same hardware, most likely), else the configured guess."""
        if w.prefill_tokens_per_s > 0:
            return w.prefill_tokens_per_s
        measured = [v.prefill_tokens_per_s for v in (*pools.prefill, *pools.decode) if v.prefill_tokens_per_s > 0]
        return max(measured, default=self.cfg.default_prefill_tokens_per_s)


def _pool_unusable(pools: PoolsNow) -> PathChoice | None:
    """The direct path when the prefill pool's path cannot be taken, and why."""
    if not pools.prefill:
        return PathChoice(DIRECT, NO_PREFILL_WORKER)
    if not pools.kvstore_up:
        return PathChoice(DIRECT, KVSTORE_DOWN)
    return None


def path_policy(cfg: RoutingConfig, colocated: bool) -> PathPolicy:
    """`colocated`: the router was given no prefill pool at all (not one that is down)."""
    if colocated or cfg.paths.policy == "colocated":
        return ColocatedPaths()
    if cfg.paths.policy == "threshold":
        return ThresholdPaths(cfg.short_prompt_tokens, cfg.slo_classes)
    return AdaptivePaths(cfg.paths, cfg.slo_classes)
