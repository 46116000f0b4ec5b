"""The engine's own step-cost estimates, which workers report to the router."""
from __future__ import annotations

import math

import pytest

from pdserve.engine import InvalidRequestError, SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.step_rates import MIN_PREFILL_TOKENS_FOR_RATE, StepRates
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.slo import SLOTargets


def test_pure_decode_steps_measure_the_decode_step():
    rates = StepRates()
    rates.observe(0, 4, 0.05)
    assert rates.decode_step_s == pytest.approx(0.05) and rates.prefill_tokens_per_s == 0.0
    rates.observe(0, 4, 0.10)
    assert 0.05 < rates.decode_step_s < 0.10  # an average that moves toward the new steps


def test_prefill_rate_discounts_the_decode_part_of_mixed_steps():
    rates = StepRates(decode_step_s=0.05)
    rates.observe(500, 3, 0.55)  # 0.5 s of it prefill
    assert rates.prefill_tokens_per_s == pytest.approx(1000)
    alone = StepRates(decode_step_s=0.05)
    alone.observe(500, 0, 0.5)  # no decode in the step: all of it is prefill
    assert alone.prefill_tokens_per_s == pytest.approx(1000)


def test_small_prefills_and_empty_steps_leave_the_rate_alone():
    rates = StepRates(decode_step_s=0.05)
    rates.observe(MIN_PREFILL_TOKENS_FOR_RATE - 1, 3, 0.06)
    rates.observe(0, 0, 0.01)
    assert rates.prefill_tokens_per_s == 0.0 and rates.decode_step_s == pytest.approx(0.05)


def test_a_small_step_without_decodes_still_measures_the_rate():
    """A time-bounded prefill step can be a single block: with no decode beside it, all of
    its time is prefill, so it measures the rate however small it is."""
    rates = StepRates()
    rates.observe(16, 0, 0.1)
    assert rates.prefill_tokens_per_s == pytest.approx(160)


def test_prompt_tokens_within_a_step_take_the_decodes_share_off():
    rates = StepRates(decode_step_s=0.05, prefill_tokens_per_s=1000.0)
    assert rates.prefill_tokens_within(0.25, with_decodes=False) == 250
    assert rates.prefill_tokens_within(0.25, with_decodes=True) == 200
    assert rates.prefill_tokens_within(0.04, with_decodes=True) == 0  # the decodes alone exceed it
    assert StepRates().prefill_tokens_within(0.25, with_decodes=False) == 0  # not measured yet


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    # no prefix caching: the same prompt is computed again, chunk by chunk
    return EngineCore(EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_cache_memory_bytes=8 << 20,
                                                                           enable_prefix_caching=False),
                                   scheduler=SchedulerConfig(max_model_len=256)), progress=False)


def _run(engine: EngineCore, req_id: str, prompt: list[int], **kwargs) -> tuple[list[int], list[int]]:
    """The request's tokens, and the prompt tokens each step computed for it."""
    engine.add_request(EngineRequest(req_id, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                     **kwargs))
    chunks, tokens = [], []
    while engine.has_unfinished_requests():
        before = engine.scheduler.requests[req_id].num_computed_tokens if req_id in engine.scheduler.requests else None
        for out in engine.step():
            tokens = out.token_ids
        request = engine.scheduler.requests.get(req_id)
        if before is not None and before < len(prompt):
            after = request.num_computed_tokens if request is not None else len(prompt)
            chunks.append(min(after, len(prompt)) - before)
    return tokens, chunks


def test_engine_reports_measured_rates_in_its_stats(engine):
    _run(engine, "rates", list(range(1, 100)))
    stats = engine.stats()
    assert stats.prefill_tokens_per_s > 0 and stats.decode_step_ms > 0


def test_a_request_can_ask_for_smaller_prefill_chunks_with_the_same_tokens(engine):
    prompt = list(range(3, 103))
    whole, whole_chunks = _run(engine, "whole", prompt)
    capped, capped_chunks = _run(engine, "capped", prompt, prefill_chunk_tokens=16)
    assert whole_chunks == [100] and capped_chunks == [16] * 6 + [4]
    assert capped == whole
    with pytest.raises(InvalidRequestError, match="prefill_chunk_tokens"):
        engine.add_request(EngineRequest("bad", prompt, SamplingParams(max_tokens=1), prefill_chunk_tokens=-1))
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRequestError, match="slo.ttft_budget_s"):
            engine.add_request(EngineRequest("bad", prompt, SamplingParams(max_tokens=1),
                                             slo=SLOTargets(ttft_budget_s=bad)))
        with pytest.raises(InvalidRequestError, match="slo.itl_target_s"):
            engine.add_request(EngineRequest("bad", prompt, SamplingParams(max_tokens=1),
                                             slo=SLOTargets(itl_target_s=bad)))


def test_engine_reports_the_tpot_room_of_its_streams(engine):
    """A stream with an ITL target counts once it has its first token: its room is what
    its target leaves over the tokens still to come, less their steps; none before."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("paced", list(range(3, 40)), params, slo=SLOTargets(itl_target_s=1.0)))
    assert engine.stats().tpot_stall_room_ms == math.inf  # still prefilling
    while engine.scheduler.requests["paced"].num_output_tokens < 4:
        engine.step()
    room_ms = engine.stats().tpot_stall_room_ms
    # 39 gaps of 1 s less what 3 took and 36 more decode steps (a few ms each here)
    assert 30_000 < room_ms < 39_000
    engine.abort_request("paced")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().tpot_stall_room_ms == math.inf


def test_requests_asking_for_small_chunks_share_one_steps_room(engine):
    """The cap is the ITL room of the streams a prompt joins: a second capped prompt on the
    same worker waits for the first's chunks instead of doubling each step. An uncapped
    prompt is not held back by it, and each prompt's tokens stay its own."""
    first, second = list(range(3, 103)), list(range(7, 87))
    alone = {name: _run(engine, f"{name}-alone", prompt)[0] for name, prompt in (("a", first), ("b", second))}
    engine.add_request(EngineRequest("a", first, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                     prefill_chunk_tokens=16))
    engine.add_request(EngineRequest("b", second, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                     prefill_chunk_tokens=16))
    engine.add_request(EngineRequest("c", list(range(5, 45)), SamplingParams(max_tokens=1, temperature=0.0)))
    prefill_per_step, outputs = [], {}
    while engine.has_unfinished_requests():
        before = {r: q.num_computed_tokens for r, q in engine.scheduler.requests.items()}
        for out in engine.step():
            outputs[out.req_id] = out.token_ids
        after = {r: q.num_computed_tokens for r, q in engine.scheduler.requests.items()}
        capped = sum(min(after.get(r, len(p)), len(p)) - before[r]
                     for r, p in (("a", first), ("b", second)) if r in before and before[r] < len(p))
        prefill_per_step.append(capped)
    assert max(prefill_per_step) == 16, prefill_per_step   # never 32: one step's room, shared
    assert sum(prefill_per_step) == len(first) + len(second)
    assert outputs["a"] == alone["a"] and outputs["b"] == alone["b"]
    assert len(outputs["c"]) == 1
