"""srpt on a real engine (the tiny model): a short prompt queued behind a long one gets its
first token before the long one's, counted in steps, and the order changes which step
computes what, never the tokens.

The steps are bounded in time (max_step_ms, as on a prefill worker), at a prefill rate
fixed here rather than measured: 250 ms at 64 tokens/s is 16 prompt tokens a step (32
beside decodes, the floor that keeps the rate measured), so the wall clock decides
nothing. Switching the order off (fcfs) fails every test here."""
from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.request import RequestMode
from pdserve.engine.stats import QueuedPrefill
from pdserve.engine.step_rates import StepRates

LONG = list(range(1000, 1300))   # 300 tokens: 19 steps of 16
SHORT = list(range(2000, 2020))  # 20 tokens: 2 steps
BATCH = list(range(3000, 3010))


class FixedRates(StepRates):
    """Step costs that executed steps do not move: the time bound's chunks are exact."""

    def observe(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        pass


def _engine(tiny, tiny_llama_dir, policy: str) -> EngineCore:
    # the token budgets are far above what the time bound allows: it alone sizes the chunks
    scheduler = SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=512, max_model_len=512,
                                scheduling_policy=policy, max_step_ms=250)
    # no prefix caching: the tests reuse prompts on one engine, and a hit would skip chunks
    cache = CacheConfig(kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    engine = EngineCore(EngineConfig(model=tiny_llama_dir, cache=cache, scheduler=scheduler),
                        progress=False, loaded=tiny)
    engine.step_rates = engine.scheduler.rates = FixedRates(prefill_tokens_per_s=64.0)  # 16 tokens in 250 ms
    return engine


@pytest.fixture(scope="module")
def engines(tiny, tiny_llama_dir):
    return {policy: _engine(tiny, tiny_llama_dir, policy) for policy in ("srpt", "fcfs")}


def _request(req_id: str, prompt: list[int], mode: RequestMode, max_tokens: int = 1, priority: int = 0):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(req_id, prompt, params, mode=mode, priority=priority)


def _run(engine: EngineCore, arrivals: dict[int, list[EngineRequest]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Steps until all are done, adding arrivals[k] before step k (1-based); the step of
    each request's first token, and its tokens."""
    first_step, tokens, step = {}, {}, 0
    while step == 0 or engine.has_unfinished_requests() or step + 1 in arrivals:
        step += 1
        for request in arrivals.get(step, []):
            engine.add_request(request)
        for out in engine.step():
            if out.token_ids:
                first_step.setdefault(out.req_id, step)
                tokens[out.req_id] = list(out.token_ids)
    return first_step, tokens


def test_an_interactive_prompt_behind_a_long_one_gets_its_first_token_first(engines):
    """A prefill worker's engine (prefill-only requests): the long prompt has run one chunk
    when the short one arrives. srpt: the short one's 20 tokens go first (step 2: 16; step
    3: 4, beside 12 of the long one's), so its first token comes at step 3 and the long
    prompt's at step 20 (its 300 tokens and the short one's 20, 16 a step); fcfs: the short
    one waits for all 19 of the long one's chunks, sharing only the last."""
    arrivals = lambda: {1: [_request("long", LONG, RequestMode.PREFILL_ONLY)],  # noqa: E731
                        2: [_request("short", SHORT, RequestMode.PREFILL_ONLY)]}
    srpt_steps, srpt_tokens = _run(engines["srpt"], arrivals())
    fcfs_steps, fcfs_tokens = _run(engines["fcfs"], arrivals())
    assert srpt_steps == {"short": 3, "long": 20}
    assert fcfs_steps == {"long": 19, "short": 20}
    assert srpt_tokens == fcfs_tokens


def test_the_order_serves_the_class_first_and_keeps_every_token(engines):
    """Colocated requests that decode after their prompt: a batch-class short prompt waits for
    the interactive work; decodes keep running beside the prompt chunks; each request's
    tokens are the same under either order."""
    def arrivals():
        return {1: [_request("long", LONG, RequestMode.COLOCATED, max_tokens=6),
                    _request("batch", BATCH, RequestMode.COLOCATED, max_tokens=6, priority=1)],
                3: [_request("short", SHORT, RequestMode.COLOCATED, max_tokens=6)]}
    srpt_steps, srpt_tokens = _run(engines["srpt"], arrivals())
    _, fcfs_tokens = _run(engines["fcfs"], arrivals())
    # (the chunks' sizes change once decodes run beside them: the rule's floor, not the order's)
    assert srpt_steps["short"] < srpt_steps["long"] < srpt_steps["batch"]
    assert srpt_tokens == fcfs_tokens and all(len(t) == 6 for t in srpt_tokens.values())


def test_the_engine_reports_its_queue_as_its_order_ranks_it(engines):
    """What a prefill worker sends the router (WorkerLoad.queued_prefill): after the long
    prompt's first 16 tokens, its 284 left rank 284 (nothing computed for others yet) and
    the newcomer's 20 rank 20; and the step bound it schedules by."""
    engine = engines["srpt"]
    engine.add_request(_request("long", LONG, RequestMode.PREFILL_ONLY))
    engine.step()
    engine.add_request(_request("short", SHORT, RequestMode.PREFILL_ONLY))
    stats = engine.stats()
    assert stats.queued_prefill == (QueuedPrefill(0, 16, 32, 1, 20), QueuedPrefill(0, 256, 512, 1, 284))
    assert stats.max_step_ms == 250
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().queued_prefill == ()
