"""The engine's stats as WorkerLoad: the ranked prefill queue and the step bound reach the
router whole (issue 33: its TTFT estimate follows the worker's own order)."""
from __future__ import annotations

from pdserve.engine.stats import EngineStats, QueuedPrefill
from pdserve.services.router.state.workers import view_from_load
from pdserve.services.worker.servicer import load_to_proto


def test_the_ranked_queue_and_the_step_bound_travel_to_the_routers_view():
    queued = (QueuedPrefill(0, 0, 16, 2, 30), QueuedPrefill(1, 4096, 8192, 1, 5000))
    stats = EngineStats(num_waiting=3, num_queued_prefill_tokens=5030, prefill_tokens_per_s=900.0,
                        queued_prefill=queued, max_step_ms=250.0)
    load = load_to_proto(stats, max_num_seqs=8, draining=False)
    assert [(q.priority, q.min_rank_tokens, q.max_rank_tokens, q.num_requests, q.num_tokens)
            for q in load.queued_prefill] == [(0, 0, 16, 2, 30), (1, 4096, 8192, 1, 5000)]
    view = view_from_load("w:1", load)
    assert (view.queued_prefill, view.max_step_ms, view.num_queued_prefill_tokens) == (queued, 250.0, 5030)


def test_an_idle_engine_reports_an_empty_queue():
    view = view_from_load("w:1", load_to_proto(EngineStats(), max_num_seqs=8, draining=False))
    assert (view.queued_prefill, view.max_step_ms) == ((), 0.0)
