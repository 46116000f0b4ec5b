"""When a worker takes no more work from this router: past its queue, its prefill
backlog, its KV room or this router's own bound on requests outstanding on it."""
from __future__ import annotations

from pdserve.services.router.decide.config import SaturationConfig
from pdserve.services.router.decide.views import WorkerView


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


def decode_prefill_backlog(w: WorkerView) -> int:
    """Prompt tokens a decode worker has yet to compute: its report and what this router
    sent since. Not its in-flight tokens, which hold each direct stream's prompt for the
    stream's whole life, long after the prompt was computed."""
    return w.num_queued_prefill_tokens + w.unreported_tokens


def prefill_work_ahead(w: WorkerView, priority: int, rank: int) -> int:
    """Prompt tokens a new request of `priority` that ranks `rank` (its length, or less
    under a deadline: prefill_order.rank_on_arrival) waits for on prefill
    worker w, in the worker's own order (WorkerLoad.queued_prefill): the buckets of a more
    urgent priority, and those of its own whose ranks may go first (a bucket the request
    falls inside counts whole: at most one bucket of error, on the safe side); and what
    this router sent since the worker's report, not ranked there yet, whole. A worker with
    prefill work queued that reports no ranks: its whole backlog."""
    if w.num_queued_prefill_tokens and not w.queued_prefill:
        return prefill_backlog(w)
    ranked = sum(q.num_tokens for q in w.queued_prefill
                 if q.priority < priority or q.priority == priority and q.min_rank_tokens < rank)
    return ranked + w.unreported_tokens
