"""Greedy output of every engine path equals transformers on a tiny random Llama (GQA)."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, SchedulerConfig, CacheConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from tests.engine.correctness import MODES, run_added_mid_run, run_llm, varied_prompts
from tests.engine.hf_reference import hf_greedy, load_hf_model

MAX_TOKENS = 24
LENGTHS = [1, 7, 16, 17, 33, 64, 130, 300]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    loaded = load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)
    prompts = varied_prompts(loaded.arch.vocab_size, LENGTHS)
    expected = hf_greedy(load_hf_model(tiny_llama_dir), prompts, MAX_TOKENS, loaded.eos_token_ids)
    return loaded, prompts, expected


def _assert_all_blocks_free(llm_engine) -> None:
    kv = llm_engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hf(tiny, tiny_llama_dir, mode):
    loaded, prompts, expected = tiny
    got, llm = run_llm(loaded, tiny_llama_dir, prompts, MAX_TOKENS, **MODES[mode])
    assert got == expected
    _assert_all_blocks_free(llm.engine)


def test_prefix_cache_hits_are_token_exact(tiny, tiny_llama_dir):
    loaded, prompts, expected = tiny
    _, llm = run_llm(loaded, tiny_llama_dir, prompts, MAX_TOKENS)
    before = llm.engine.kv_manager.num_hit_tokens
    again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         __import__("pdserve.engine").engine.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in again] == expected
    assert llm.engine.kv_manager.num_hit_tokens - before >= sum(len(p) // 16 - 1 for p in prompts if len(p) > 16)
    assert any(o.num_cached_tokens > 0 for o in again)


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_preemption_under_tiny_kv_budget(tiny, tiny_llama_dir, enable_chunked_prefill):
    loaded, prompts, expected = tiny
    # unchunked, a preempted request resumes by recomputing all its tokens in one step
    budget = 2048 if enable_chunked_prefill else None
    got, llm = run_llm(loaded, tiny_llama_dir, prompts, MAX_TOKENS, kv_cache_memory_bytes=24 * 8192,
                       enable_chunked_prefill=enable_chunked_prefill, max_num_batched_tokens=budget)
    assert llm.engine.kv_manager.pool.num_blocks == 24
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    _assert_all_blocks_free(llm.engine)


def test_requests_added_mid_run(tiny, tiny_llama_dir):
    loaded, prompts, expected = tiny
    config = EngineConfig(model=tiny_llama_dir, cache=CacheConfig(),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=32))
    engine = EngineCore(config, progress=False, loaded=loaded)
    assert run_added_mid_run(engine, prompts, MAX_TOKENS) == expected
    _assert_all_blocks_free(engine)


def test_unchunked_budget_must_hold_max_model_len(tiny, tiny_llama_dir):
    loaded, _, _ = tiny
    config = EngineConfig(model=tiny_llama_dir, scheduler=SchedulerConfig(
        max_num_batched_tokens=256, max_model_len=512, enable_chunked_prefill=False))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineCore(config, progress=False, loaded=loaded)


def test_unchunked_budget_defaults_to_max_model_len(tiny, tiny_llama_dir):
    loaded, _, _ = tiny
    config = EngineConfig(model=tiny_llama_dir, scheduler=SchedulerConfig(
        max_num_batched_tokens=None, max_model_len=512, enable_chunked_prefill=False))
    assert EngineCore(config, progress=False, loaded=loaded).scheduler.config.max_num_batched_tokens == 512
