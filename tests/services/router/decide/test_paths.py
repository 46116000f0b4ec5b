"""Path policies on WorkerView snapshots: which path each request takes, and why."""
from __future__ import annotations

import pytest

from services.router.config import PathConfig, SLOClass
from services.router.decide.paths import (DIRECT, DISAGGREGATED, NO_PREFILL_WORKER, AdaptivePaths, ColocatedPaths,
                                          PathChoice, PoolsNow, ThresholdPaths)
from services.router.decide.views import WorkerView

CLASSES = {"interactive": SLOClass(ttft_ms=1000, itl_ms=100), "batch": SLOClass(ttft_ms=30000, itl_ms=1000, priority=1)}


def _w(address: str, **load) -> WorkerView:
    return WorkerView(address, up=True, max_num_seqs=64, num_total_kv_blocks=100, num_free_kv_blocks=100, **load)


def _pools(prefill=None, decode=None, **decode_load) -> PoolsNow:
    return PoolsNow(prefill if prefill is not None else [_w("p", prefill_tokens_per_s=1000)],
                    decode if decode is not None else [_w("d", prefill_tokens_per_s=1000, decode_step_ms=60,
                                                          **decode_load)])


def test_threshold_by_prompt_length_and_class():
    classes = {"interactive": SLOClass(100, 10), "batch": SLOClass(1000, 100, 1, short_prompt_tokens=0)}
    paths = ThresholdPaths(32, classes)
    assert paths.choose(32, "interactive", _pools()).path == DIRECT
    assert paths.choose(33, "interactive", _pools()).path == DISAGGREGATED
    assert paths.choose(1, "batch", _pools()).path == DISAGGREGATED  # the class's own threshold
    # the prefill pool is down: long prompts fall back, counted by their reason
    assert paths.choose(33, "interactive", _pools(prefill=[])).reason == NO_PREFILL_WORKER
    assert paths.choose(10, "interactive", _pools(prefill=[])).reason == "short_prompt"


def test_colocated_is_always_direct():
    assert ColocatedPaths().choose(10_000, "batch", _pools()).path == DIRECT


def test_adaptive_keeps_a_prompt_direct_when_its_prefill_fits_the_itl_budget():
    paths = AdaptivePaths(PathConfig(), CLASSES)
    # 100 ms ITL - 60 ms step = 40 ms of room at 1000 tokens/s: 40 tokens
    assert paths.choose(40, "interactive", _pools()) == PathChoice(DIRECT, "fits_itl_budget")
    assert paths.choose(41, "interactive", _pools()).path == DISAGGREGATED


def test_adaptive_sends_short_prompts_to_an_idle_prefill_pool():
    choice = AdaptivePaths(PathConfig(), CLASSES).choose(200, "interactive", _pools())
    assert (choice.path, choice.reason) == (DISAGGREGATED, "prefill_pool")


def test_adaptive_uses_measured_rates_not_constants():
    paths = AdaptivePaths(PathConfig(default_prefill_tokens_per_s=1000), CLASSES)
    fast_decode = [_w("d", prefill_tokens_per_s=10_000, decode_step_ms=20)]
    # 80 ms of room at 10k tokens/s: 800 tokens fit where the constant would allow 50
    assert paths.choose(700, "interactive", _pools(decode=fast_decode)).reason == "fits_itl_budget"
    # not measured yet anywhere: the configured guesses
    unmeasured = PoolsNow([_w("p")], [_w("d")])
    assert paths.choose(50, "interactive", unmeasured).reason == "fits_itl_budget"   # 50 ms step, 1000 tok/s
    assert paths.choose(51, "interactive", unmeasured).path == DISAGGREGATED


def test_adaptive_keeps_short_prompts_on_the_decode_worker_while_the_pool_is_busy():
    paths = AdaptivePaths(PathConfig(min_direct_chunk_tokens=32), CLASSES)
    busy = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=5000)]  # 5 s of queue
    choice = paths.choose(100, "interactive", _pools(prefill=busy))
    # in chunks of 40 tokens: 40 ms of room per step at 1000 tokens/s
    assert choice == PathChoice(DIRECT, "prefill_pool_busy", prefill_chunk_tokens=40)
    # 10 ms of room: 10 tokens fit a step, chunks are at least min_direct_chunk_tokens (32);
    # a prompt within one chunk runs whole, with no cap
    slow = [_w("d", prefill_tokens_per_s=1000, decode_step_ms=90)]
    assert paths.choose(30, "interactive", _pools(prefill=busy, decode=slow)) == PathChoice(DIRECT, "prefill_pool_busy")
    assert paths.choose(100, "interactive", _pools(prefill=busy, decode=slow)).prefill_chunk_tokens == 32


def test_adaptive_never_stalls_running_streams_with_a_long_prompt():
    paths = AdaptivePaths(PathConfig(max_direct_stall_itls=5), CLASSES)
    busy = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=5000)]
    # 1000 tokens stall the decode worker 1 s: more than 5 ITL targets of 100 ms
    assert paths.choose(1000, "interactive", _pools(prefill=busy)) == PathChoice(DISAGGREGATED,
                                                                                   "prefill_pool_backlogged")
    assert paths.choose(1000, "batch", _pools(prefill=busy)) == PathChoice(DISAGGREGATED, "prefill_pool")


def test_adaptive_uses_the_pool_when_the_decode_worker_would_be_later():
    paths = AdaptivePaths(PathConfig(), CLASSES)
    busy = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=1500)]  # 1.5 s of queue
    busy_decode = [_w("d", prefill_tokens_per_s=1000, decode_step_ms=60, num_queued_prefill_tokens=3000)]
    assert paths.choose(100, "interactive", _pools(prefill=busy, decode=busy_decode)).path == DISAGGREGATED


def test_adaptive_without_prefill_pool_falls_back_and_says_so():
    paths = AdaptivePaths(PathConfig(), CLASSES)
    assert paths.choose(500, "interactive", _pools(prefill=[])) == PathChoice(DIRECT, NO_PREFILL_WORKER)


@pytest.mark.parametrize("policy", ["bogus", ""])
def test_path_config_names_the_bad_policy(policy):
    with pytest.raises(ValueError, match="path policy"):
        PathConfig(policy=policy)
