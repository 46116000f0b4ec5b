"""How long a step may last (engine/core/step_bound.py): the configured bound, lengthened for
steps that only prefill by the tightest TTFT target of the last minute's requests; and the
scheduler's chunks following it. Pure Python, a fake clock, no model."""
from __future__ import annotations

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.block_hash import model_fingerprint
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.step_bound import STEP_SHARE_OF_TTFT, TARGET_MEMORY_S, StepBound
from pdserve.engine.request import Request
from pdserve.engine.slo import SLOTargets
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_rates import MIN_PREFILL_TOKENS_FOR_RATE, StepRates

from tests.engine.core.scheduler_steps import run_step as _step


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_tightest_recent_target_sizes_a_step_that_only_prefills():
    clock = _Clock()
    bound = StepBound(150.0, clock)
    assert bound.step_ms(with_decodes=False) == 150.0  # nothing seen: the configured bound
    bound.note_arrival(6.0)
    assert bound.step_ms(with_decodes=False) == 6000 * STEP_SHARE_OF_TTFT == 750.0
    assert bound.step_ms(with_decodes=True) == 150.0   # an inter-token gap: the ITL's bound
    clock.t += 10
    bound.note_arrival(2.0)
    assert bound.step_ms(with_decodes=False) == 250.0
    clock.t += 10
    bound.note_arrival(30.0)                            # looser: the tighter one still holds
    assert bound.step_ms(with_decodes=False) == 250.0
    clock.t += TARGET_MEMORY_S - 15                     # 2 s arrived 55 s ago, 30 s 45 s ago
    assert bound.step_ms(with_decodes=False) == 250.0
    clock.t += 10                                       # 2 s forgotten (6 s long since)
    assert bound.step_ms(with_decodes=False) == 30000 * STEP_SHARE_OF_TTFT


def test_a_tight_target_or_none_keeps_the_configured_bound_for_a_minute():
    clock = _Clock()
    bound = StepBound(150.0, clock)
    bound.note_arrival(6.0)
    bound.note_arrival(1.0)                             # an interactive class: 125 ms < 150
    assert bound.step_ms(with_decodes=False) == 150.0
    clock.t += TARGET_MEMORY_S - 1
    bound.note_arrival(6.0)
    assert bound.step_ms(with_decodes=False) == 150.0   # the 1 s target still remembered
    clock.t += 2
    assert bound.step_ms(with_decodes=False) == 750.0
    bound.note_arrival(0.0)                             # no target given: nothing is known
    assert bound.step_ms(with_decodes=False) == 150.0
    clock.t += TARGET_MEMORY_S + 1                      # every target forgotten
    assert bound.step_ms(with_decodes=False) == 150.0


def test_a_worker_bounded_by_tokens_alone_stays_so():
    bound = StepBound(0.0, _Clock())
    bound.note_arrival(6.0)
    assert bound.step_ms(with_decodes=False) == 0.0


def _scheduler(clock: _Clock, rates: StepRates) -> Scheduler:
    kv = KVCacheManager(256, 4, model_fingerprint("m", "f32", 1, 1, 1, 4))
    cfg = SchedulerConfig(max_model_len=1024, scheduling_policy="srpt", max_num_batched_tokens=2048,
                          long_prefill_token_threshold=2048, max_step_ms=150)
    return Scheduler(cfg, kv, rates, StepBound(cfg.max_step_ms, clock))


def _add(s: Scheduler, req_id: str, n: int, min_class_ttft_s: float, max_tokens: int = 1) -> Request:
    base = 1000 * (len(s.requests) + s.clock + 1)
    r = Request(EngineRequest(req_id, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens),
                              slo=SLOTargets(min_class_ttft_s=min_class_ttft_s)))
    s.add_request(r)
    return r


def test_prompt_chunks_follow_the_bound_and_a_newcomer_waits_one_such_step():
    clock = _Clock()
    s = _scheduler(clock, StepRates(decode_step_s=0.05, prefill_tokens_per_s=100.0))
    _add(s, "long", 1000, min_class_ttft_s=6.0)
    assert s.step_ms() == 750.0
    assert _step(s) == {"long": 75}                     # 750 ms at 100 tokens/s, not 150 ms's 15
    _add(s, "short", 20, min_class_ttft_s=6.0)
    assert list(_step(s).items()) == [("short", 20), ("long", 55)]  # srpt: it joins the next step
    _add(s, "interactive", 8, min_class_ttft_s=1.0)        # a 1 s target: back to 150 ms steps
    assert list(_step(s).items()) == [("interactive", 8), ("long", 7)]
    clock.t += TARGET_MEMORY_S + 1
    _add(s, "stream", 4, min_class_ttft_s=6.0, max_tokens=50)
    assert _step(s) == {"stream": 4, "long": 71}        # 71 + 4: 750 ms of prompt again
    assert s.step_ms() == 150.0                         # a stream decodes: its gaps keep 150 ms
    # 100 ms of prompt beside a 50 ms decode is 10 tokens: the floor beside decodes
    assert _step(s) == {"stream": 1, "long": MIN_PREFILL_TOKENS_FOR_RATE}
