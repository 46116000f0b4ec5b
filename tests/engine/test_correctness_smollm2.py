"""Greedy output of every engine path equals transformers on the embedded SmolLM2 (GGUF)."""
from __future__ import annotations

import pytest

from pdserve.engine import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from tests.engine.correctness import MODES, run_added_mid_run, run_llm
from tests.engine.hf_reference import hf_greedy, load_hf_model

MAX_TOKENS = 16
_PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps "
              "as his father had, and lit the lamp before the fog rolled in from the grey sea. ")
TEXTS = [
    "Hi",
    "The capital of France is",
    "List three colours of the rainbow:",
    "Once upon a time, in a small village by the mountains,",
    _PARAGRAPH * 3 + "What did the keeper count?",
    _PARAGRAPH * 10 + "Summarise the story in one sentence:",
    _PARAGRAPH * 10 + "Who taught the keeper his habit?",  # shares a long prefix with the previous
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path, smollm2_loaded):
    loaded = smollm2_loaded
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    assert min(map(len, prompts)) == 1 and max(map(len, prompts)) > 300
    expected = hf_greedy(load_hf_model(smollm2_path), prompts, MAX_TOKENS, loaded.eos_token_ids)
    return loaded, prompts, expected


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_hf(smollm2, mode):
    loaded, prompts, expected = smollm2
    got, llm = run_llm(loaded, "smollm2", prompts, MAX_TOKENS, **MODES[mode])
    assert got == expected
    if mode == "prefix_cache_on":
        assert llm.engine.kv_manager.num_hit_tokens > 300  # the shared paragraph prefix


def test_preemption_and_mid_run_adds(smollm2):
    loaded, prompts, expected = smollm2
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4
    config = EngineConfig(model="smollm2",
                          cache=CacheConfig(kv_cache_memory_bytes=28 * block_bytes),
                          scheduler=SchedulerConfig(max_num_batched_tokens=96, long_prefill_token_threshold=64))
    engine = EngineCore(config, progress=False, loaded=loaded)
    assert run_added_mid_run(engine, prompts, MAX_TOKENS) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_text_and_chat_api(smollm2):
    from pdserve.engine import LLM, SamplingParams
    loaded, _, _ = smollm2
    llm = LLM("smollm2", loaded_model=loaded, progress=False)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.text.startswith(" Paris")
    assert out.text == loaded.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in chat.text
    assert chat.prompt.endswith("<|im_start|>assistant\n")
