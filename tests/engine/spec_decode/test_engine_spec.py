"""Speculative decoding in the engine: output equals the engine without it, token for token,
for both proposers, on every path; rejected drafts leave nothing behind."""
from __future__ import annotations

import re

import pytest

from pdserve.engine import LLM, CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from pdserve.engine.core.block_hash import hash_full_blocks
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import RequestMode
from pdserve.engine.spec_decode import SpeculativeConfig
from pdserve.engine.structured import StructuredOutputsParams
from tests.engine.correctness import run_to_completion
from tests.models import build_tiny_llama
from pdserve.engine.engine_request import EngineRequest

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama: layers, K and V, block size, KV heads, head dim, float32


def _repetitive(tokenizer) -> list[list[int]]:
    """Prompts whose continuation copies spans of them (what n-gram lookup is for)."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    listing = "red green blue, red green blue, red green blue, red green"
    return [tokenizer.encode(code), tokenizer.encode(listing), tokenizer.encode("one two three four " * 6)]


# ---- the tiny random target: cheap enough to run every path ----------------------------------
@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A second random model with the same tokenizer: its drafts are almost all rejected."""
    import torch

    from pdserve.engine.model.loader import load_model
    from pdserve.engine.model.source import resolve_model
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), num_layers=1, hidden_size=32, num_heads=2,
                            num_kv_heads=1, seed=11)
    return path, load_model(resolve_model(path), torch.float32, "cpu", progress=False)


def _engine(tiny, tiny_llama_dir, spec=None, prefix_caching=True, kv_blocks=256, **scheduler) -> EngineCore:
    config = EngineConfig(model=tiny_llama_dir, speculative_config=SpeculativeConfig.from_dict(spec),
                          cache=CacheConfig(kv_cache_memory_bytes=kv_blocks * BLOCK_BYTES,
                                            enable_prefix_caching=prefix_caching),
                          scheduler=SchedulerConfig(**scheduler))
    return EngineCore(config, progress=False, loaded=tiny)


_run = run_to_completion


PROMPTS = [list(range(300, 340)), [5, 6, 7, 8] * 8, list(range(1200, 1213)), list(range(300, 330)) + [9, 9, 9] * 5]


def _requests(**params):
    return [(f"r{i}", p, SamplingParams(**{"temperature": 0, "max_tokens": 24, **params})) for i, p in enumerate(PROMPTS)]


def _specs(tiny_llama_dir, tiny_draft):
    return {"ngram": NGRAM,
            "draft_self": {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3},
            "draft_random": {"method": "draft_model", "model": tiny_draft[0], "num_speculative_tokens": 3}}


@pytest.mark.parametrize("path", ["plain", "chunked", "preempted", "stops_and_logprobs", "seeded", "guided"])
def test_speculation_changes_no_token(tiny, tiny_llama_dir, tiny_draft, path):
    scheduler = {"chunked": dict(long_prefill_token_threshold=7, max_num_batched_tokens=24),
                 "preempted": dict(max_num_batched_tokens=64, long_prefill_token_threshold=16)}.get(path, {})
    kv_blocks = 12 if path == "preempted" else 256
    params = {"stops_and_logprobs": dict(stop=["9"], stop_token_ids=[1300], logprobs=3),
              "seeded": dict(temperature=0.9, top_p=0.95, seed=5),
              # drafts are checked against the grammar, and each scored row gets its own mask
              "guided": dict(structured_outputs=StructuredOutputsParams(
                  regex=r"(ab|cd|[0-9]{2}){3,6}"), max_tokens=30)}.get(path, {})
    expected = _run(_engine(tiny, tiny_llama_dir, kv_blocks=kv_blocks, **scheduler), _requests(**params))
    for name, spec in _specs(tiny_llama_dir, tiny_draft).items():
        engine = _engine(tiny, tiny_llama_dir, spec, kv_blocks=kv_blocks, **scheduler)
        got = _run(engine, _requests(**params))
        for req_id, out in expected.items():
            assert got[req_id].token_ids == out.token_ids, (path, name, req_id)
            assert got[req_id].text == out.text and got[req_id].finish_reason == out.finish_reason
            if out.logprobs is not None:
                assert [lp.token_id for lp in got[req_id].logprobs] == [lp.token_id for lp in out.logprobs]
                assert [lp.logprob for lp in got[req_id].logprobs] == pytest.approx(
                    [lp.logprob for lp in out.logprobs], abs=1e-4)
        stats = engine.stats()
        if path == "guided":
            assert all(re.fullmatch(r"(ab|cd|[0-9]{2}){3,6}", o.text) for o in got.values())
        # random samples rarely repeat an n-gram; a random model's unguided guesses rarely pass a grammar
        if not ((name == "ngram" and path == "seeded") or (name != "ngram" and path == "guided")):
            assert stats.num_spec_proposed_tokens > 0, name
        if name == "draft_self" and path != "seeded":  # the target's own greedy guesses: all kept
            assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens
        if path == "preempted":
            assert engine.scheduler.num_preemptions > 0
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_rejected_drafts_leave_no_trace_in_the_pool_or_the_prefix_cache(tiny, tiny_llama_dir, tiny_draft):
    spec = _specs(tiny_llama_dir, tiny_draft)["draft_random"]
    engine = _engine(tiny, tiny_llama_dir, spec)
    outs = _run(engine, _requests(max_tokens=40))
    stats = engine.stats()
    assert stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens  # rejections happened
    pool, bs = engine.kv_manager.pool, engine.config.cache.block_size
    valid = set()
    for out in outs.values():
        # every block hash a real sequence has: prompt + output (the last token's KV never computed)
        tokens = out.prompt_token_ids + out.token_ids
        valid.update(hash_full_blocks(engine.root_hash, tokens[:len(tokens) - 1], bs))
    cached = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    assert cached and cached <= valid
    assert engine.kv_manager.num_free_blocks == pool.num_blocks


def test_max_tokens_is_never_overshot_and_big_batches_turn_speculation_off(tiny, tiny_llama_dir):
    engine = _engine(tiny, tiny_llama_dir, {**NGRAM, "disable_by_batch_size": 2})
    outs = _run(engine, [("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))])
    assert len(outs["a"].token_ids) == 5
    proposed = engine.stats().num_spec_proposed_tokens
    assert proposed > 0
    _run(engine, _requests(max_tokens=6))  # 4 running requests > 2: no drafts at all
    assert engine.stats().num_spec_proposed_tokens == proposed


def test_a_prefill_only_request_never_speculates_and_decode_continues(tiny, tiny_llama_dir):
    prefill = _engine(tiny, tiny_llama_dir, NGRAM)
    decode = _engine(tiny, tiny_llama_dir, NGRAM)
    expected = _run(_engine(tiny, tiny_llama_dir), _requests())
    params = SamplingParams(temperature=0, max_tokens=24)
    for i, p in enumerate(PROMPTS):
        prefill.add_request(EngineRequest(f"p{i}", p, params, mode=RequestMode.PREFILL_ONLY))
    firsts = {}
    while prefill.has_unfinished_requests():
        firsts.update({o.req_id: o for o in prefill.step() if o.finished})
    assert prefill.stats().num_spec_proposed_tokens == 0
    for i, p in enumerate(PROMPTS):
        decode.add_request(EngineRequest(f"r{i}", p, params, mode=RequestMode.DECODE_ONLY,
                           output_token_ids=firsts[f"p{i}"].token_ids, kv_import=firsts[f"p{i}"].kv_export))
    outs = {}
    while decode.has_unfinished_requests():
        outs.update({o.req_id: o for o in decode.step() if o.finished})
    assert {r: o.token_ids for r, o in outs.items()} == {r: o.token_ids for r, o in expected.items()}
    assert decode.stats().num_spec_proposed_tokens > 0


def test_streamed_deltas_add_up_to_the_whole_output(tiny, tiny_llama_dir):
    engine = _engine(tiny, tiny_llama_dir, NGRAM)
    engine.add_request(EngineRequest("s", PROMPTS[1], SamplingParams(temperature=0, max_tokens=30)))
    tokens, text = [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.new_text
    assert tokens == out.token_ids and text == out.text
    assert engine.stats().num_spec_accepted_tokens > 0  # some steps emitted several tokens


# ---- SmolLM2: greedy with speculation equals greedy without ----------------------------------
def test_smollm2_greedy_is_unchanged_by_either_proposer(smollm2_loaded, tiny_draft):
    tokenizer = smollm2_loaded.tokenizer
    prompts = [{"prompt_token_ids": ids} for ids in _repetitive(tokenizer)]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM("smollm2", loaded_model=smollm2_loaded, progress=False, kv_cache_memory_bytes=64 << 20)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    for spec in (NGRAM, {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": tiny_draft[0], "num_speculative_tokens": 3}):
        llm = LLM("smollm2", loaded_model=smollm2_loaded, progress=False, speculative_config=spec,
                  kv_cache_memory_bytes=64 << 20)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected, spec
        stats = llm.engine.stats()
        assert stats.num_spec_proposed_tokens > 0
        if spec.get("model") != tiny_draft[0]:
            assert stats.num_spec_accepted_tokens > 0
        if spec.get("model") == "smollm2":
            assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens
