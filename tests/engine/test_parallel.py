"""Tensor and pipeline parallelism (engine/executor/): every t x p engine gives the tokens
of the single-rank engine (itself token-exact with transformers, test_correctness_*.py),
greedy and seeded, through chunked prefill, prefix caching and pipeline micro-batches; KV
blocks leave and enter whole whatever the TP size; a dead rank stops the engine with an
error naming it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import EngineDeadError, InvalidRequestError
from pdserve.engine.executor.config import ParallelConfig
from pdserve.engine.kv_transfer import KVPayload
from pdserve.engine.request import RequestMode
from tests.engine.correctness import varied_prompts
from pdserve.engine.engine_request import EngineRequest

# chunked prefill (16-token chunks, 64-token steps) and prefix caching (the last prompt
# shares most of the one before): the paths a parallel forward must not change
ENGINE_KW = dict(long_prefill_token_threshold=16, max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 24,
                 collective_timeout_s=60, progress=False)


def _params(n: int) -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0, max_tokens=10) for _ in range(n)]
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=10) for i in range(n)]
    return greedy + seeded


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], _params(len(prompts)))
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_prompts(tiny):
    return varied_prompts(tiny.arch.vocab_size, [5, 37, 70])


@pytest.fixture(scope="module")
def tiny_reference(tiny, tiny_llama_dir, tiny_prompts):
    return _generate(LLM(tiny_llama_dir, loaded_model=tiny, **ENGINE_KW), tiny_prompts)


@pytest.mark.parametrize("t,p", [(2, 1), (4, 1), (2, 2)])
def test_tiny_parallel_matches_single_rank(t, p, tiny_llama_dir, tiny_prompts, tiny_reference):
    """t = 4 exceeds the tiny model's 2 KV heads: each is replicated on two ranks."""
    llm = LLM(tiny_llama_dir, tensor_parallel_size=t, pipeline_parallel_size=p, **ENGINE_KW)
    try:
        assert _generate(llm, tiny_prompts) == tiny_reference
        assert llm.engine.kv_manager.num_hit_tokens > 0  # the shared prefix came from the cache
    finally:
        llm.engine.shutdown()


SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
                   "Once upon a time, in a land far away, there lived a king who had three daughters. "
                   "The youngest of them was"]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_loaded):
    llm = LLM("smollm2", loaded_model=smollm2_loaded, **ENGINE_KW)
    return _generate(llm, [llm.tokenizer.encode(p) for p in SMOLLM2_PROMPTS])


# the real model once, at t = 3 (its 9 heads and 3 KV heads) x p = 2 (15 layers a stage):
# TP and PP alone are the tiny model's cases above; each SmolLM2 engine of 6 ranks costs
# a minute or more of a 2-core CI
@pytest.mark.parametrize("t,p", [(3, 2)])
def test_smollm2_parallel_matches_single_rank(t, p, smollm2_reference):
    llm = LLM("smollm2", tensor_parallel_size=t, pipeline_parallel_size=p, **ENGINE_KW)
    try:
        assert _generate(llm, [llm.tokenizer.encode(x) for x in SMOLLM2_PROMPTS]) == smollm2_reference
    finally:
        llm.engine.shutdown()


def test_kv_blocks_are_whole_across_tp_sizes(tiny, tiny_llama_dir, tiny_prompts):
    """A t = 2 x p = 2 prefill exports whole blocks (every layer and KV head, the wire
    layout); a single-rank decode imports them and goes on with the single-rank tokens,
    and the reverse: a single-rank export imported into t = 4."""
    prompt = tiny_prompts[2]
    single = LLM(tiny_llama_dir, loaded_model=tiny, **ENGINE_KW)
    expected = single.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    single_payload = _prefill_payload(single.engine, prompt)
    parallel = LLM(tiny_llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE_KW)
    try:
        payload = _prefill_payload(parallel.engine, prompt)
        assert payload.blocks.shape == single_payload.blocks.shape
        assert payload.block_hashes == single_payload.block_hashes  # hashes do not depend on t or p
        torch.testing.assert_close(payload.blocks, single_payload.blocks, rtol=1e-4, atol=1e-5)
        assert _decode_from(single.engine, prompt, expected[0], payload) == expected
    finally:
        parallel.engine.shutdown()
    wide = LLM(tiny_llama_dir, tensor_parallel_size=4, **ENGINE_KW)
    try:
        assert _decode_from(wide.engine, prompt, expected[0], single_payload) == expected
    finally:
        wide.engine.shutdown()


def _prefill_payload(engine, prompt) -> KVPayload:
    engine.add_request(EngineRequest("prefill", prompt, SamplingParams(temperature=0, max_tokens=8),
                                     mode=RequestMode.PREFILL_ONLY))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.kv_export
    raise AssertionError("the prefill never finished")


def _decode_from(engine, prompt, first_token: int, payload: KVPayload) -> list[int]:
    engine.add_request(EngineRequest("decode", prompt, SamplingParams(temperature=0, max_tokens=8),
                                     mode=RequestMode.DECODE_ONLY, output_token_ids=[first_token], kv_import=payload))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.num_cached_tokens >= len(prompt) - len(prompt) % engine.config.cache.block_size
                return out.token_ids
    raise AssertionError("the decode never finished")


def test_killed_rank_stops_the_engine_with_an_error_naming_it(tiny_llama_dir, tiny_prompts):
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **{**ENGINE_KW, "collective_timeout_s": 20})
    engine = llm.engine
    try:
        engine.add_request(EngineRequest("a", tiny_prompts[1], SamplingParams(temperature=0, max_tokens=50)))
        engine.step()
        pid = engine.executor.rank_pids[1]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            while True:  # the watcher may see it first (check_health), or the next collective fails
                engine.check_health()
                engine.step()
        assert time.monotonic() - start < 20
        with pytest.raises(EngineDeadError):  # and it stays dead
            engine.step()
    finally:
        engine.shutdown()


def test_bad_parallel_settings_name_the_field(tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(InvalidRequestError, match="pipeline_layer_split"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layer_split=(3,))
    with pytest.raises(InvalidRequestError, match="pipeline_layer_split.*adds up to 3 layers; the model has 2"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layer_split=(1, 2)).stage_layers(2)
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size: 3 does not divide the model's 4 attention heads"):
        LLM(tiny_llama_dir, tensor_parallel_size=3, **ENGINE_KW)
