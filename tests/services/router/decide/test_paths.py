"""Path policies on WorkerView snapshots: which path each request takes, and why."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pdserve.services.router.config import PathConfig, SLOClass
from pdserve.services.router.decide.paths import (DIRECT, DISAGGREGATED, NO_PREFILL_WORKER, AdaptivePaths, ColocatedPaths,
                                                  PathChoice, PoolsNow, ThresholdPaths)
from pdserve.services.router.decide.saturation import prefill_work_ahead
from pdserve.services.router.decide.views import QueuedPrefill, WorkerView

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
    # the streams it decodes hold their prompts as this router's in-flight tokens: those
    # are computed; what it has yet to prefill (reported, or sent since) takes the room
    assert paths.choose(40, "interactive", _pools(in_flight_tokens=5000)).reason == "fits_itl_budget"
    assert paths.choose(30, "interactive", _pools(num_queued_prefill_tokens=10)).reason == "fits_itl_budget"
    assert paths.choose(30, "interactive", _pools(unreported_tokens=11)).path == DISAGGREGATED


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
    paths = AdaptivePaths(PathConfig(min_direct_chunk_tokens=16), CLASSES)
    busy = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=5000)]  # 5 s of queue
    choice = paths.choose(100, "interactive", _pools(prefill=busy))
    # 40 ms of room per step at 1000 tokens/s, half of it for a prompt of several chunks:
    # chunks of 20 tokens, so that the streams' mean gap stays under the target
    assert choice == PathChoice(DIRECT, "prefill_pool_busy", prefill_chunk_tokens=20)
    # 10 ms of room: 5 tokens a step, chunks are at least min_direct_chunk_tokens (16);
    # a prompt within one chunk runs whole, with no cap
    slow = [_w("d", prefill_tokens_per_s=1000, decode_step_ms=90)]
    assert paths.choose(16, "interactive", _pools(prefill=busy, decode=slow)) == PathChoice(DIRECT, "prefill_pool_busy")
    assert paths.choose(100, "interactive", _pools(prefill=busy, decode=slow)).prefill_chunk_tokens == 16


def test_adaptive_counts_the_steps_of_the_prompts_queued_on_the_decode_worker():
    """Prompts queued there share one step's room: a queue of 800 tokens in chunks of 20 is
    40 more steps of 60 ms, not 0.8 s of prefill alone."""
    paths = AdaptivePaths(PathConfig(), CLASSES)
    behind = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=3000)]  # about 3.1 s
    assert paths.choose(100, "interactive", _pools(prefill=behind)) == PathChoice(
        DIRECT, "prefill_pool_busy", prefill_chunk_tokens=20)
    # 0.8 s + 45 steps x 60 ms + 0.1 s + its 0.1 s stall = 3.7 s: the pool is sooner
    queued = paths.choose(100, "interactive", _pools(prefill=behind, num_queued_prefill_tokens=800))
    assert queued.path == DISAGGREGATED


def test_adaptive_never_stalls_running_streams_with_a_long_prompt():
    paths = AdaptivePaths(PathConfig(max_direct_stall_itls=5), CLASSES)
    busy = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=5000)]
    # 1000 tokens stall the decode worker 1 s: more than 5 ITL targets of 100 ms
    assert paths.choose(1000, "interactive", _pools(prefill=busy)) == PathChoice(
        DISAGGREGATED, "prefill_pool_backlogged", decode_address="d")
    assert paths.choose(1000, "batch", _pools(prefill=busy)) == PathChoice(DISAGGREGATED, "prefill_pool",
                                                                             decode_address="d")


def test_adaptive_gives_a_long_prompt_to_the_decode_worker_when_the_pool_misses_its_ttft():
    """The operator's SLO (6 s TTFT, 150 ms ITL): a pool 9 s behind misses the target; the
    decode worker meets it in chunks that keep its steps within 150 ms, so it takes the
    prompt. Not when the prompts queued there, or its own chunks, take it past the target."""
    classes = {"interactive": SLOClass(ttft_ms=6000, itl_ms=150)}
    paths = AdaptivePaths(PathConfig(max_direct_stall_itls=5), classes)
    behind = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=8000)]
    # 90 ms of room at 1000 tokens/s, half of it for a rescued prompt: chunks of 45;
    # 23 steps x 60 ms + 1 s = 2.4 s <= 6 s
    assert paths.choose(1000, "interactive", _pools(prefill=behind)) == PathChoice(
        DIRECT, "prefill_pool_misses_ttft", prefill_chunk_tokens=45)
    # a pool that meets the target keeps the prompt: the isolation the pools exist for
    on_time = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=3000)]
    assert paths.choose(1000, "interactive", _pools(prefill=on_time)).reason == "prefill_pool"
    # after 500 prompt tokens queued there, in the same room per step:
    # 1.5 s + 34 steps x 60 ms = 3.5 s, still within the target
    assert paths.choose(1000, "interactive", _pools(prefill=behind, num_queued_prefill_tokens=500)).reason == \
        "prefill_pool_misses_ttft"
    # after 2000 (reported, or sent by this router since): 3 s + 67 steps x 60 ms = 7 s
    assert paths.choose(1000, "interactive", _pools(prefill=behind, num_queued_prefill_tokens=2000)).reason == \
        "prefill_pool_backlogged"
    assert paths.choose(1000, "interactive", _pools(prefill=behind, unreported_tokens=2000)).reason == \
        "prefill_pool_backlogged"
    # streams decoding there hold their prompts as in-flight tokens: not prefill work left
    assert paths.choose(1000, "interactive", _pools(prefill=behind, in_flight_tokens=9000)).reason == \
        "prefill_pool_misses_ttft"
    # 10 ms of room: chunks of 8 (the floor), 750 steps x 140 ms, far past 6 s
    slow = [_w("d", prefill_tokens_per_s=1000, decode_step_ms=140)]
    assert paths.choose(6000, "interactive", _pools(prefill=behind, decode=slow)).reason == "prefill_pool_backlogged"


def test_a_rescue_runs_in_longer_steps_when_the_streams_tpot_room_takes_its_prefill():
    """The decode worker's streams could be paused 3 s and keep their TPOT targets: a
    rescued 1000-token prompt (1 s of prefill, within half that room) runs in 250 ms steps,
    not in chunks of half the ITL room. Less room, or prompts queued there that use it
    up, keep the small chunks; with no room reported, nothing changes."""
    classes = {"interactive": SLOClass(ttft_ms=6000, itl_ms=150)}
    paths = AdaptivePaths(PathConfig(max_direct_stall_itls=5, rescue_step_ms=250), classes)
    behind = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=8000)]
    assert paths.choose(1000, "interactive", _pools(prefill=behind, tpot_stall_room_ms=3000)) == PathChoice(
        DIRECT, "prefill_pool_misses_ttft_tpot_room", prefill_chunk_tokens=250)
    # 1 s of prefill against half of 1.5 s: the ITL room's chunks of 45
    assert paths.choose(1000, "interactive", _pools(prefill=behind, tpot_stall_room_ms=1500)) == PathChoice(
        DIRECT, "prefill_pool_misses_ttft", prefill_chunk_tokens=45)
    # 600 tokens queued there first: 1.6 s of pause against half of 3 s
    assert paths.choose(1000, "interactive", _pools(prefill=behind, tpot_stall_room_ms=3000,
                                                    num_queued_prefill_tokens=600)).prefill_chunk_tokens == 45
    assert paths.choose(1000, "interactive", _pools(prefill=behind)).prefill_chunk_tokens == 45
    # no stream keeps a target there (inf): those joining while it runs would see only
    # long steps, so the ITL room's chunks
    assert paths.choose(1000, "interactive", _pools(prefill=behind, tpot_stall_room_ms=math.inf)
                        ).prefill_chunk_tokens == 45
    # rescue_step_ms 0: the ITL room's chunks whatever the TPOT room
    small = AdaptivePaths(PathConfig(max_direct_stall_itls=5, rescue_step_ms=0), classes)
    assert small.choose(1000, "interactive", _pools(prefill=behind, tpot_stall_room_ms=3000)
                        ).prefill_chunk_tokens == 45


def test_a_rescue_the_itl_room_would_make_late_is_on_time_in_the_tpot_room():
    """A 3000-token prompt on a decode worker with 10 ms of ITL room: chunks of 8, 375
    steps of 140 ms, 55 s; in 250 ms steps, 12 of them, 3 s + 1.7 s, within the 6 s target."""
    classes = {"interactive": SLOClass(ttft_ms=6000, itl_ms=150)}
    paths = AdaptivePaths(PathConfig(max_direct_stall_itls=5), classes)
    behind = [_w("p", prefill_tokens_per_s=1000, num_queued_prefill_tokens=8000)]
    slow = dict(prefill_tokens_per_s=1000, decode_step_ms=140)
    assert paths.choose(3000, "interactive", _pools(prefill=behind, decode=[_w("d", **slow)])).reason == \
        "prefill_pool_backlogged"
    roomy = [_w("d", tpot_stall_room_ms=10_000, **slow)]
    assert paths.choose(3000, "interactive", _pools(prefill=behind, decode=roomy)) == PathChoice(
        DIRECT, "prefill_pool_misses_ttft_tpot_room", prefill_chunk_tokens=250)


@pytest.mark.parametrize("ms", [-1.0, float("nan"), float("inf")])
def test_path_config_names_a_bad_rescue_step(ms):
    with pytest.raises(ValueError, match="rescue_step_ms"):
        PathConfig(rescue_step_ms=ms)


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


# ---- the prefill pool's estimate under the worker's own order (WorkerLoad.queued_prefill) ----
def _ranked(*buckets, **load) -> WorkerView:
    """A prefill worker at 1000 tokens/s with a 250 ms step bound and these queue buckets."""
    queued = tuple(QueuedPrefill(*b) for b in buckets)
    return _w("p", prefill_tokens_per_s=1000, max_step_ms=250, queued_prefill=queued,
              num_queued_prefill_tokens=sum(q.num_tokens for q in queued), **load)


def test_work_ahead_counts_the_buckets_that_go_first():
    # one 5000-token prompt ranked ~4.7k, two short ones ranked <= 16, a batch prompt
    w = _ranked((0, 0, 16, 2, 30), (0, 4096, 8192, 1, 5000), (1, 32, 64, 1, 40))
    assert prefill_work_ahead(w, priority=0, rank=100) == 30            # not the long one
    assert prefill_work_ahead(w, priority=0, rank=4097) == 5030         # its bucket counts whole
    assert prefill_work_ahead(w, priority=1, rank=10) == 5030           # every more urgent one
    assert prefill_work_ahead(w, priority=1, rank=33) == 5070
    # what this router sent since the report is not ranked there: it counts whole
    assert prefill_work_ahead(replace(w, unreported_tokens=700), 0, 100) == 730
    # a worker that reports no ranks: its backlog, as before
    assert prefill_work_ahead(_w("p", num_queued_prefill_tokens=5000), 0, 100) == 5000
    assert prefill_work_ahead(_w("p"), 0, 100) == 0


def test_adaptive_sends_a_short_prompt_to_a_pool_busy_only_with_longer_ones():
    """The case of issue 33: the pool holds a 5 s prompt, but its srpt order takes a 100-token
    prompt first, so its first token is one step (250 ms) + 100 ms + the hand-off away: the
    pool, not the decode worker the backlog alone would choose."""
    paths = AdaptivePaths(PathConfig(min_direct_chunk_tokens=32), CLASSES)
    long_queued = _ranked((0, 4096, 8192, 1, 5000))
    assert paths.choose(100, "interactive", _pools(prefill=[long_queued])) == PathChoice(
        DISAGGREGATED, "prefill_pool", decode_address="d")
    # the same backlog unranked (an fcfs worker ranks it all first): the decode worker
    fcfs = _ranked((0, 0, 16, 1, 5000))
    assert paths.choose(100, "interactive", _pools(prefill=[fcfs])).reason == "prefill_pool_busy"
    # a batch prompt waits for the interactive work, however short it is
    assert paths.choose(1000, "batch", _pools(prefill=[long_queued])) == PathChoice(DISAGGREGATED, "prefill_pool",
                                                                                      decode_address="d")


def test_adaptive_estimate_ranks_the_prompt_as_its_deadline_lets_the_worker():
    """A 600-token prompt with a 1 s target at 1000 tokens/s behind a 250 ms step: 750
    tokens of budget, so the worker lets only 150 go first: a queued 400-token prompt
    (ranked in 256-512) waits behind it. With a 30 s target (the batch class, priority
    aside) it ranks by length, 600, and that prompt goes first."""
    paths = AdaptivePaths(PathConfig(kv_handoff_ms=0), CLASSES)
    w = _ranked((0, 256, 512, 1, 400))
    assert paths._prefill_ttft_s(w, 600, CLASSES["interactive"], _pools(prefill=[w])) == pytest.approx(0.25 + 0.6)
    loose = SLOClass(ttft_ms=30000, itl_ms=100)
    assert paths._prefill_ttft_s(w, 600, loose, _pools(prefill=[w])) == pytest.approx(0.25 + 1.0)


def test_adaptive_estimate_adds_the_step_in_flight():
    paths = AdaptivePaths(PathConfig(kv_handoff_ms=20), CLASSES)
    w = _ranked((0, 4096, 8192, 1, 5000))
    assert paths._prefill_ttft_s(w, 100, CLASSES["interactive"],
                                 _pools(prefill=[w])) == pytest.approx(0.1 + 0.25 + 0.02)
    assert paths._prefill_ttft_s(replace(w, max_step_ms=0), 100, CLASSES["interactive"],
                                 _pools(prefill=[w])) == pytest.approx(0.12)
    # a step in flight lasts no longer than the backlog takes: nothing on an idle worker
    idle = _ranked()
    assert paths._prefill_ttft_s(idle, 100, CLASSES["interactive"], _pools(prefill=[idle])) == pytest.approx(0.12)
    short = _ranked((0, 0, 16, 1, 50))
    assert paths._prefill_ttft_s(short, 100, CLASSES["interactive"], _pools(prefill=[short])) == pytest.approx(0.05 + 0.15 + 0.02)
