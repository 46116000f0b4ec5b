"""Workers of both roles (`pdserve decode --role both`), listed in both pools: the path
policies never hand a prompt over from a worker to itself, and read a worker that also
decodes as the slower prefill worker it is."""
from __future__ import annotations

import pytest

from pdserve.services.router.config import PathConfig, SLOClass
from pdserve.services.router.decide.paths import (DIRECT, DISAGGREGATED, KVSTORE_DOWN, SAME_WORKER, AdaptivePaths, PathChoice,
                                                  PoolsNow, ThresholdPaths, prefill_rate_beside_decodes)
from pdserve.services.router.decide.views import WorkerView

CLASSES = {"interactive": SLOClass(ttft_ms=1000, itl_ms=100), "batch": SLOClass(ttft_ms=30000, itl_ms=1000, priority=1)}


def _w(address: str, **load) -> WorkerView:
    return WorkerView(address, up=True, max_num_seqs=64, num_total_kv_blocks=100, num_free_kv_blocks=100,
                      prefill_tokens_per_s=1000, **load)


def _both(address: str, **load) -> WorkerView:
    """A worker of both roles: its decode steps measured, its steps bounded at 100 ms."""
    return _w(address, max_step_ms=100, **load)


def test_a_worker_alone_in_both_pools_prefills_its_long_prompts_itself():
    a = _both("a", decode_step_ms=60)
    alone = PoolsNow([a], [a])
    assert AdaptivePaths(PathConfig(), CLASSES).choose(1000, "interactive", alone) == PathChoice(DIRECT, SAME_WORKER)
    assert ThresholdPaths(32, CLASSES).choose(1000, "interactive", alone) == PathChoice(DIRECT, SAME_WORKER)
    # a prompt that fits the ITL budget is direct for that reason, as on any decode worker
    assert AdaptivePaths(PathConfig(), CLASSES).choose(30, "interactive", alone).reason == "fits_itl_budget"
    # the kvstore being down says more than same_worker: it is why no worker could hand over
    down = PoolsNow([a], [a], kvstore_up=False)
    assert AdaptivePaths(PathConfig(), CLASSES).choose(1000, "interactive", down) == PathChoice(DIRECT, KVSTORE_DOWN)


def test_a_both_worker_with_idle_prefill_takes_a_long_prompt_for_another_decode_worker():
    # d (a decode worker) has the most room; b decodes 6 streams but has no prompt queued
    d, b = _w("d", decode_step_ms=60), _both("b", num_running=6, decode_step_ms=20)
    choice = AdaptivePaths(PathConfig(), CLASSES).choose(600, "interactive", PoolsNow([b], [d, b]))
    # 600 tokens stall d's streams past 5 ITL targets; b computes 80 per 100 ms step beside its
    # decodes (800 tokens/s): 0.77 s, within the 1 s TTFT target
    assert choice == PathChoice(DISAGGREGATED, "prefill_pool", decode_address="d")


def test_two_both_workers_hand_prompts_to_each_other():
    a, b = _both("a", decode_step_ms=60), _both("b", decode_step_ms=60)
    paths = AdaptivePaths(PathConfig(), CLASSES)
    # ties go to the first listed for the decode: the other one prefills
    assert paths.choose(600, "batch", PoolsNow([a, b], [a, b])) == PathChoice(DISAGGREGATED, "prefill_pool",
                                                                              decode_address="a")
    busy_a = _both("a", decode_step_ms=60, num_running=30)
    assert paths.choose(600, "batch", PoolsNow([busy_a, b], [busy_a, b])).decode_address == "b"
    # one of them down: the other would hand over to itself, so it prefills directly
    assert paths.choose(600, "batch", PoolsNow([b], [b])) == PathChoice(DIRECT, SAME_WORKER)
    assert ThresholdPaths(32, CLASSES).choose(600, "batch", PoolsNow([a, b], [a, b])) == PathChoice(
        DISAGGREGATED, "long_prompt", decode_address="a")


def test_the_prefill_estimate_leaves_out_the_decode_worker_itself():
    """a is the decode worker (most room) and would be the fastest prefill; the estimate is
    b's, the only worker that can hand over to a: backlogged, past the TTFT target."""
    a = _both("a", decode_step_ms=60)
    b = _both("b", decode_step_ms=60, num_running=2, num_queued_prefill_tokens=3000)
    choice = AdaptivePaths(PathConfig(), CLASSES).choose(600, "interactive", PoolsNow([a, b], [a, b]))
    assert choice == PathChoice(DISAGGREGATED, "prefill_pool_backlogged", decode_address="a")


def test_a_worker_that_decodes_prefills_only_what_its_step_bound_leaves():
    busy = _both("b", num_running=4, decode_step_ms=60)
    # 100 ms steps: 60 of decode, 40 tokens of prompt at 1000 tokens/s -> 400 tokens/s
    assert prefill_rate_beside_decodes(busy, 1000) == pytest.approx(400)
    # the scheduler's floor beside decodes (32 tokens) when the decodes fill the bound
    slow = _both("b", num_running=4, decode_step_ms=100)
    assert prefill_rate_beside_decodes(slow, 1000) == pytest.approx(32 / 0.132)
    # nothing running, a prefill worker (no decode step measured), no step bound: the rate itself
    assert prefill_rate_beside_decodes(_both("b", decode_step_ms=60), 1000) == 1000
    assert prefill_rate_beside_decodes(_w("p", num_running=4, max_step_ms=150), 1000) == 1000
    assert prefill_rate_beside_decodes(_w("d", num_running=4, decode_step_ms=60), 1000) == 1000
