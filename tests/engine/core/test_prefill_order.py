"""srpt and the step's time bound (engine/core/prefill_order.py, Scheduler._step_budget):
exact chunks and orders, pure Python, no model."""
from __future__ import annotations

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.block_hash import model_fingerprint
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.prefill_order import LATE_AGING_DIVISOR, NO_RANK_LIMIT, rank_on_arrival
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.request import Request
from pdserve.engine.slo import SLOTargets
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stats import QueuedPrefill
from pdserve.engine.step_rates import MIN_PREFILL_TOKENS_FOR_RATE, StepRates

from tests.engine.core.scheduler_steps import run_step as _step


def _scheduler(num_blocks=256, block_size=4, rates=None, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, model_fingerprint("m", "f32", 1, 1, 1, block_size))
    cfg = {"max_model_len": 1024, "scheduling_policy": "srpt", **cfg}
    return Scheduler(SchedulerConfig(**cfg), kv, rates)


def _add(s: Scheduler, req_id: str, n: int, max_tokens: int = 1, priority: int = 0,
         ttft_budget_s: float = 0.0) -> Request:
    base = 1000 * (len(s.requests) + s.clock + 1)  # distinct prompts: no prefix-cache sharing
    r = Request(EngineRequest(req_id, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens),
                              priority=priority, slo=SLOTargets(ttft_budget_s=ttft_budget_s)))
    s.add_request(r)
    return r


def test_a_short_prompt_arriving_behind_a_long_one_joins_the_next_step():
    s = _scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    _add(s, "long", 40)
    assert _step(s) == {"long": 8}
    short = _add(s, "short", 6)
    assert list(_step(s).items()) == [("short", 6), ("long", 2)]
    assert short.num_output_tokens == 1  # its first token, while the long prompt has 30 to go
    assert [_step(s) for _ in range(4)] == [{"long": 8}] * 3 + [{"long": 6}]


def test_fcfs_keeps_the_short_prompt_behind_the_long_ones_chunks():
    s = _scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8, scheduling_policy="fcfs")
    _add(s, "long", 40)
    _step(s)
    _add(s, "short", 6)
    assert [_step(s) for _ in range(5)] == [{"long": 8}] * 4 + [{"short": 6}]


def test_priority_comes_before_length():
    s = _scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    _add(s, "batch-short", 4, priority=1)
    _add(s, "interactive-long", 20, priority=0)
    _add(s, "interactive-short", 6, priority=0)
    assert list(_step(s).items()) == [("interactive-short", 6), ("interactive-long", 2)]
    assert list(_step(s).items()) == [("interactive-long", 8)]
    assert list(_step(s).items()) == [("interactive-long", 8)]
    assert list(_step(s).items()) == [("interactive-long", 2), ("batch-short", 4)]


def test_decodes_go_first_then_prefills_by_remaining_tokens():
    s = _scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=6)
    _add(s, "long", 30, max_tokens=4)
    _add(s, "decoder", 3, max_tokens=4)
    assert list(_step(s).items()) == [("decoder", 3), ("long", 6)]
    _add(s, "short", 5, max_tokens=4)
    # running order is long, decoder; the decode goes first, then the shorter prompt
    assert list(_step(s).items()) == [("decoder", 1), ("short", 5), ("long", 4)]


def _run_under_stream(num_long: int, budget: int, short_len: int, shorts_per_step: int, max_steps: int):
    """A long prompt, then `shorts_per_step` new short prompts before every step; the steps
    until the long one's first token (None: not within max_steps), and each step's share."""
    s = _scheduler(max_num_batched_tokens=budget, long_prefill_token_threshold=budget)
    long = _add(s, "long", num_long)
    shares = []
    for i in range(max_steps):
        for j in range(shorts_per_step):
            _add(s, f"short{i}.{j}", short_len)
        shares.append(_step(s).get("long", 0))
        if long.status.finished:
            return i + 1, shares
    return None, shares


def test_aging_the_long_prompt_waits_for_short_ones_then_none_overtake_it():
    """A new 8-token prompt every step fills the whole 8-token budget: without aging the
    64-token prompt would never run. Its rank falls by 8 a step (64 - 8k after k shorts);
    at 8 it ties the newcomer and goes first, then runs to its end."""
    steps, shares = _run_under_stream(64, budget=8, short_len=8, shorts_per_step=1, max_steps=100)
    assert shares == [0] * 7 + [8] * 8 and steps == 15


@pytest.mark.parametrize("num_long,budget,short_len,shorts_per_step", [
    (64, 8, 8, 1),      # the stream fills every step
    (64, 8, 3, 2),      # less than the worker's rate: steps shared
    (100, 16, 5, 4),    # more than the worker's rate (20 tokens a step against 16)
    (500, 32, 24, 3),   # far more (72 against 32)
])
def test_aging_a_long_prompt_finishes_within_the_stated_bound(num_long, budget, short_len, shorts_per_step):
    """docs/architecture.md's bound: a prompt of R tokens arriving with nothing ahead of it
    finishes within ceil((R + A) / F) steps, F the step's prompt tokens and A the prompt
    work that arrives in the ceil(R / F) steps after it (later arrivals rank behind it)."""
    window = -(-num_long // budget)
    arrived = short_len * shorts_per_step * window
    bound = -(-(num_long + arrived) // budget)
    steps, _ = _run_under_stream(num_long, budget, short_len, shorts_per_step, max_steps=10 * bound)
    assert steps is not None and steps <= bound


def test_a_running_prompt_does_not_preempt_one_admitted_in_the_same_step():
    # 6 blocks of 4: the long prompt holds 5 after its first step; the short one takes the
    # last; the long one's next chunk then waits a step rather than undo that admission
    s = _scheduler(num_blocks=6, max_num_batched_tokens=20, long_prefill_token_threshold=20)
    long = _add(s, "long", 24)
    assert _step(s) == {"long": 20}
    _add(s, "short", 3)
    assert _step(s) == {"short": 3}
    assert s.num_preemptions == 0
    assert _step(s) == {"long": 4} and long.num_output_tokens == 1


def test_the_time_bound_sizes_prompt_chunks_from_the_measured_rate():
    rates = StepRates()
    s = _scheduler(max_num_batched_tokens=2048, long_prefill_token_threshold=512, max_step_ms=250, rates=rates)
    _add(s, "a", 1000)
    assert _step(s) == {"a": 512}   # no rate measured yet: the token budgets alone
    rates.prefill_tokens_per_s = 100.0
    assert _step(s) == {"a": 25}    # 250 ms at 100 tokens/s
    rates.prefill_tokens_per_s = 10.0
    assert _step(s) == {"a": 4}     # 2.5 tokens: never below one block


def test_the_time_bound_takes_the_decodes_measured_share_of_the_step_off():
    rates = StepRates(decode_step_s=0.05, prefill_tokens_per_s=1000.0)
    s = _scheduler(max_num_batched_tokens=2048, long_prefill_token_threshold=512, max_step_ms=250, rates=rates)
    _add(s, "decoder", 3, max_tokens=8)
    assert _step(s) == {"decoder": 3}  # prompt of 3 tokens: within the 250 the bound allows
    _add(s, "long", 1000)
    assert _step(s) == {"decoder": 1, "long": 200}  # 200 ms of prompt beside a 50 ms decode
    _add(s, "short", 8)
    assert list(_step(s).items()) == [("decoder", 1), ("short", 8), ("long", 192)]


def test_beside_decodes_a_chunk_stays_large_enough_to_measure_the_rate():
    # a rate measured far too low (25 tokens in 250 ms) must not shrink every chunk below
    # what StepRates measures beside decodes (MIN_PREFILL_TOKENS_FOR_RATE): it would stick
    rates = StepRates(decode_step_s=0.05, prefill_tokens_per_s=100.0)
    s = _scheduler(max_num_batched_tokens=2048, long_prefill_token_threshold=512, max_step_ms=250, rates=rates)
    _add(s, "decoder", 3, max_tokens=8)
    _step(s)
    _add(s, "long", 100)
    assert _step(s) == {"decoder": 1, "long": MIN_PREFILL_TOKENS_FOR_RATE}


def test_the_time_bound_needs_chunked_prefill():
    with pytest.raises(ValueError, match="max_step_ms"):
        SchedulerConfig(max_step_ms=250, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
    for bad in (-1, float("nan"), float("inf"), "250", True):
        with pytest.raises(ValueError, match="max_step_ms: must be a number of milliseconds >= 0"):
            SchedulerConfig(max_step_ms=bad)


def test_the_queue_report_ranks_work_as_the_order_takes_it():
    s = _scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    _add(s, "long", 100)
    _step(s)  # 92 left; the clock at 8
    _add(s, "short", 10)
    _add(s, "batch", 40, priority=1)
    assert s.queued_prefill() == (QueuedPrefill(0, 0, 16, 1, 10), QueuedPrefill(0, 64, 128, 1, 92),
                                  QueuedPrefill(1, 32, 64, 1, 40))
    _step(s)  # short 8 (clock 16): the long prompt's rank falls by the 8 computed for another
    assert s.requests["long"].num_computed_tokens == 8
    assert s.queued_prefill()[1] == QueuedPrefill(0, 64, 128, 1, 92)
    assert s.order.rank(s.requests["long"], s.clock) == 84


def test_fcfs_reports_every_queued_request_ahead_of_a_newcomer():
    s = _scheduler(max_num_batched_tokens=8, scheduling_policy="fcfs")
    _add(s, "a", 100000)
    _add(s, "b", 30)
    assert s.queued_prefill() == (QueuedPrefill(0, 0, 16, 2, 100030),)


def test_an_unbounded_rank_lands_in_the_last_bucket():
    s = _scheduler(max_model_len=200000, max_num_batched_tokens=8)
    _add(s, "huge", 100000)
    assert s.queued_prefill() == (QueuedPrefill(0, 65536, NO_RANK_LIMIT, 1, 100000),)


# ---- deadlines: a prefill worker's request carries the time left to its TTFT target -------

def _long_under_shorts(ttft_budget_s: float, max_step_ms: float = 0.0):
    """A 40-token prompt with the given budget at 10 prompt tokens/s (400 tokens of work =
    40 s), then a new 6-token prompt before every 8-token step. Returns the clock (prompt
    tokens computed since it arrived) when the long prompt got its first token, and the
    steps' shares of it until then."""
    s = _scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8, max_step_ms=max_step_ms,
                   rates=StepRates(prefill_tokens_per_s=10.0))
    long = _add(s, "long", 40, ttft_budget_s=ttft_budget_s)
    shares = []
    for i in range(40):
        shares.append(_step(s).get("long", 0))
        if long.status.finished:
            return s.clock, shares
        _add(s, f"short{i}", 6)
    raise AssertionError(f"the long prompt did not finish: {shares}")


def test_a_deadline_lets_newer_prompts_overtake_only_while_it_can_still_be_met():
    # 5.6 s at 10 tokens/s: 56 tokens of work until its first token is due, 40 of them its
    # own, so 16 of others' may go first (not the 40 its length alone would let through)
    # (its own first chunk counts against the 16 as well: the rank assumes it starts over)
    done_at, shares = _long_under_shorts(ttft_budget_s=5.6)
    assert shares == [8, 2, 8, 8, 8, 6] and done_at == 48  # one short overtook it, then none
    no_deadline, shares = _long_under_shorts(ttft_budget_s=0.0)
    assert shares == [8, 2, 2, 2, 2, 8, 8, 8] and no_deadline == 64  # by length alone: four, late


def test_the_step_in_flight_is_taken_off_the_budget():
    # 5.6 s less a 0.8 s step: 48 tokens, 8 for others, which its own first chunk uses up
    # (max_step_ms does not bound these steps further: 800 ms at 10 tokens/s is 8 tokens)
    assert _long_under_shorts(ttft_budget_s=5.6, max_step_ms=800) == (40, [8] * 5)


def test_a_prompt_that_cannot_meet_its_deadline_yields_to_those_that_can_for_a_bounded_time():
    # 3 s: 30 tokens of work for a 40-token prompt, late whatever the order. It ages at a
    # quarter of the rate: each step computes 2 of its tokens and 6 of a newcomer's, so
    # its rank falls 3.5 a step from 32, and a 6-token newcomer stops overtaking after 7
    # (by length alone, after 4); however many come, at most 4 x 40 tokens of others'
    done_at, shares = _long_under_shorts(ttft_budget_s=3.0)
    assert shares == [8] + [2] * 8 + [8, 8] and done_at == 88
    assert done_at <= (LATE_AGING_DIVISOR + 1) * 40
    assert _long_under_shorts(ttft_budget_s=0.0)[0] == 64  # no deadline: by length alone


def test_a_prompt_that_needs_under_half_its_budget_orders_as_before():
    assert _long_under_shorts(ttft_budget_s=100.0) == _long_under_shorts(ttft_budget_s=0.0)


def test_a_deadline_missed_on_the_way_no_longer_holds_newer_prompts_back():
    # a batch prompt of 40 with 48 tokens of budget (8 to spare) ranks min(40, 8); interactive
    # work of a more urgent class takes 16 tokens first, so its deadline is lost: it ranks by
    # length, aging at a quarter (40 - 16 / 4 = 36 once 16 were computed for others), and a
    # 10-token prompt of its class goes before it, which its kept deadline (rank 8 - 16 = -8)
    # would have refused
    s = _scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8,
                   rates=StepRates(prefill_tokens_per_s=10.0))
    late = _add(s, "batch-long", 40, priority=1, ttft_budget_s=4.8)
    assert s.order.rank(late, s.clock) == 8
    _add(s, "interactive", 16, priority=0)
    assert [_step(s) for _ in range(2)] == [{"interactive": 8}] * 2
    assert s.order.rank(late, s.clock) == 36
    _add(s, "batch-short", 10, priority=1)
    assert list(_step(s).items()) == [("batch-short", 8)]


def test_the_deadline_needs_a_measured_rate():
    s = _scheduler(max_num_batched_tokens=8, rates=StepRates())
    r = _add(s, "long", 40, ttft_budget_s=5.6)
    assert r.clocks.deadline is None and s.order.rank(r, s.clock) == 40


def test_a_newcomers_rank_under_a_deadline():
    # 6 s less a 150 ms step at 300 tokens/s: 1,755 tokens of budget
    assert rank_on_arrival(1000, 6.0, 300.0, 150) == 755      # 755 of others' may go first
    assert rank_on_arrival(500, 6.0, 300.0, 150) == 500       # under half: its length
    assert rank_on_arrival(1900, 6.0, 300.0, 150) == 1900     # cannot be on time: its length
    assert rank_on_arrival(1755, 6.0, 300.0, 150) == 1        # none to spare: ties go to the queue
    assert rank_on_arrival(1000, 0.0, 300.0, 150) == 1000     # no target
    assert rank_on_arrival(1000, 6.0, 0.0, 150) == 1000       # no measured rate
