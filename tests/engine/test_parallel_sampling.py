"""SamplingParams.n (engine/parallel_sampling.py): n completions of one prompt, the prompt
computed once (its full blocks shared through the prefix cache), seeds s + i, no block left
behind; with chunked prefill, preemption, the prefill-only mode and aborts."""
from __future__ import annotations

import pytest

from pdserve.engine import LLM, InvalidRequestError, SamplingParams
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.request import RequestMode

BLOCK = 16
PROMPT = [{"prompt_token_ids": list(range(100, 145))}]  # 45 tokens: 2 full blocks and a tail of 13
SHARED = (45 - 1) // BLOCK * BLOCK  # what each sibling hits: 32 tokens


def _llm(tiny, tiny_llama_dir, **kwargs) -> LLM:
    """A fresh engine (an empty prefix cache), so every hit counted comes from the siblings."""
    return LLM(tiny_llama_dir, loaded_model=tiny, progress=False, block_size=BLOCK, **kwargs)


def _sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "max_tokens": 12, "ignore_eos": True, **kwargs})


@pytest.fixture(scope="module")
def single(tiny, tiny_llama_dir):
    """The tokens of a request of its own, on an engine that shares nothing (no prefix caching)."""
    llm = _llm(tiny, tiny_llama_dir, enable_prefix_caching=False)

    def run(seeds, **kwargs) -> list[list[int]]:
        return [llm.generate(PROMPT, _sampled(seed=s, **kwargs))[0].token_ids for s in seeds]
    return run


def _assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not kv.req_to_blocks and not llm.engine.families._families


def test_greedy_completions_are_identical_and_the_prompt_is_computed_once(tiny, tiny_llama_dir, single):
    llm = _llm(tiny, tiny_llama_dir)
    out, = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=4))
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.outputs[0] is out and out.token_ids == out.outputs[0].token_ids
    alone = single([None], temperature=0, max_tokens=10)[0]
    assert [c.token_ids for c in out.outputs] == [alone] * 4
    assert len({c.text for c in out.outputs}) == 1
    kv = llm.engine.kv_manager
    assert kv.num_queried_tokens == 4 * 45
    assert kv.num_hit_tokens == 3 * SHARED  # each sibling hit the first's two full blocks
    assert [c.num_cached_tokens for c in out.outputs] == [0, SHARED, SHARED, SHARED]
    _assert_all_blocks_free(llm)


def test_seeded_completions_equal_single_requests_with_seeds_s_to_s_plus_3(tiny, tiny_llama_dir, single):
    llm = _llm(tiny, tiny_llama_dir)
    out, = llm.generate(PROMPT, _sampled(seed=7, n=4))
    assert [c.token_ids for c in out.outputs] == single([7, 8, 9, 10])
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.kv_manager.num_hit_tokens == 3 * SHARED
    _assert_all_blocks_free(llm)


def test_unseeded_completions_draw_independently(tiny, tiny_llama_dir):
    out, = _llm(tiny, tiny_llama_dir).generate(PROMPT, _sampled(temperature=1.0, n=4))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_with_chunked_prefill_siblings_wait_for_the_first_chunks(tiny, tiny_llama_dir, single):
    """Chunks of 16: the first computes the prompt over three steps; its siblings join once
    it has allocated both full blocks, and do not compute them again."""
    llm = _llm(tiny, tiny_llama_dir, long_prefill_token_threshold=BLOCK)
    out, = llm.generate(PROMPT, _sampled(seed=3, n=4))
    assert [c.token_ids for c in out.outputs] == single([3, 4, 5, 6])
    assert llm.engine.kv_manager.num_hit_tokens == 3 * SHARED
    _assert_all_blocks_free(llm)


def test_other_requests_are_not_held_behind_waiting_siblings(tiny, tiny_llama_dir):
    llm = _llm(tiny, tiny_llama_dir, long_prefill_token_threshold=BLOCK)
    engine = llm.engine
    engine.add_request(EngineRequest("fan", PROMPT[0]["prompt_token_ids"], _sampled(seed=1, n=3)))
    engine.add_request(EngineRequest("other", list(range(500, 510)), _sampled(seed=1)))
    engine.step()  # the first sibling's first chunk; its siblings wait, "other" does not
    running = [r.req_id for r in engine.scheduler.running]
    assert running == ["fan", "other"]
    assert [r.req_id for r in engine.scheduler.waiting] == ["fan#1", "fan#2"]
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_blocks_free(llm)


def test_preempted_siblings_resume_and_still_match(tiny, tiny_llama_dir, single):
    llm = _llm(tiny, tiny_llama_dir, kv_cache_memory_bytes=12 * 8192)
    assert llm.engine.kv_manager.pool.num_blocks == 12
    out, = llm.generate(PROMPT, _sampled(seed=11, n=4, max_tokens=60))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in out.outputs] == single([11, 12, 13, 14], max_tokens=60)
    _assert_all_blocks_free(llm)


def test_prefill_only_hands_off_each_first_token_and_exports_the_kv_once(tiny, tiny_llama_dir, single):
    engine = _llm(tiny, tiny_llama_dir).engine
    prompt = PROMPT[0]["prompt_token_ids"]
    engine.add_request(EngineRequest("p", prompt, _sampled(seed=20, n=3), mode=RequestMode.PREFILL_ONLY))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.index: o for o in engine.step() if o.finished})
    assert sorted(finals) == [0, 1, 2] and {o.req_id for o in finals.values()} == {"p"}
    assert {o.finish_reason for o in finals.values()} == {"handoff"}
    assert sum(o.kv_export is not None for o in finals.values()) == 1
    assert next(o for o in finals.values() if o.kv_export).kv_export.num_tokens == 45
    assert [finals[i].token_ids for i in range(3)] == [t[:1] for t in single([20, 21, 22], max_tokens=1)]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_abort_ends_every_completion(tiny, tiny_llama_dir):
    llm = _llm(tiny, tiny_llama_dir)
    engine = llm.engine
    engine.add_request(EngineRequest("a", PROMPT[0]["prompt_token_ids"], _sampled(n=4, max_tokens=50)))
    engine.step()
    engine.step()
    engine.abort_request("a")
    finals = [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2, 3]
    assert {o.finish_reason for o in finals} == {"abort"}
    assert not engine.has_unfinished_requests()
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("n", [0, -1, 129, 2.0, True, "2"])
def test_n_is_validated_naming_the_field(n):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(n=n)
    assert e.value.field == "n"


def test_a_continuation_has_one_completion(tiny, tiny_llama_dir):
    engine = _llm(tiny, tiny_llama_dir).engine
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(EngineRequest("d", [1, 2, 3], SamplingParams(n=2), mode=RequestMode.DECODE_ONLY,
                                         output_token_ids=[4]))
    assert e.value.field == "n"
    assert not engine.has_unfinished_requests()
