"""Sampling: seeded reproducibility, filters, logprobs, stop conditions, streaming deltas."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.source import resolve_model
from pdserve.engine.request import RequestMode
from pdserve.engine.sample.sampler import sample, seeded_sample
from pdserve.engine.engine_request import EngineRequest


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    loaded = load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False)
    return LLM(tiny_llama_dir, loaded_model=loaded, progress=False)


PROMPTS = ["The sea", "Once upon a time", "1, 2, 3,"]


def _ids(llm, params):
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    a = _ids(llm, SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))
    b = _ids(llm, SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))
    c = _ids(llm, SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True))
    assert a == b
    assert a != c


def test_seed_is_per_request_not_per_batch(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    in_batch = llm.generate(PROMPTS, [params, SamplingParams(temperature=1.0, max_tokens=20),
                                      SamplingParams(temperature=0.7, seed=9, max_tokens=3)])[0].token_ids
    assert alone == in_batch


def _run(engine, req_id, prompt, params, **kw):
    engine.add_request(EngineRequest(req_id, prompt, params, **kw))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.req_id == req_id and out.finished:
                final = out
    return final


def test_seeded_continuation_elsewhere_equals_one_engine(llm):
    # the first token sampled by a prefill-only request, the rest by a decode-only one that
    # recomputes the prompt (another worker, say): the same tokens as one colocated run
    engine = llm.engine
    prompt = llm.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    whole = llm.generate(PROMPTS[1], params)[0].token_ids
    first = _run(engine, "p", prompt, params, mode=RequestMode.PREFILL_ONLY)
    assert first.finish_reason == "handoff" and first.token_ids == whole[:1]
    for cut in (1, 5):  # resumed after the prefill's first token, or mid-stream (a migration)
        rest = _run(engine, f"d{cut}", prompt, params, mode=RequestMode.DECODE_ONLY, output_token_ids=whole[:cut])
        assert rest.token_ids == whole


def test_seeded_draw_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]])
    n = 4000
    picked = torch.cat([seeded_sample(probs, [(seed, 3)]) for seed in range(n)])
    freq = torch.bincount(picked, minlength=5).double() / n
    assert freq[4] == 0  # a filtered-out token is never drawn
    assert torch.allclose(freq[:4], probs[0, :4].double(), atol=0.03)
    # one key, one draw; neighbouring positions draw independently
    assert seeded_sample(probs, [(1, 3)]) == seeded_sample(probs, [(1, 3)])
    by_position = torch.cat([seeded_sample(probs, [(1, pos)]) for pos in range(200)])
    assert len(set(by_position.tolist())) == 4


def test_degenerate_filters_equal_greedy(llm):
    greedy = _ids(llm, SamplingParams(temperature=0, max_tokens=10))
    assert _ids(llm, SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=10)) == greedy
    assert _ids(llm, SamplingParams(temperature=0.8, top_p=1e-6, seed=3, max_tokens=10)) == greedy
    assert _ids(llm, SamplingParams(temperature=0.8, min_p=1.0, seed=3, max_tokens=10)) == greedy


def test_filters_keep_only_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    gen = torch.Generator().manual_seed(0)
    picked = set(sample(logits, [SamplingParams(temperature=5.0, top_k=2)] * 200, list(range(200)), gen).token_ids)
    assert picked == {0, 1}
    # top_p: probabilities of [4,3,2,1,0] at T=1 are .64 .24 .09 ...; p=0.8 keeps the first two
    picked = set(sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 200, list(range(200)), gen).token_ids)
    assert picked == {0, 1}
    picked = set(sample(logits, [SamplingParams(temperature=1.0, min_p=0.3)] * 200, list(range(200)), gen).token_ids)
    assert picked == {0, 1}  # 0.24 / 0.64 > 0.3 > 0.09 / 0.64


def test_logprobs_of_greedy_tokens_are_the_top_ones(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top_logprobs) == 3
        assert max(lp.top_logprobs, key=lp.top_logprobs.get) == tok
        assert lp.logprob == pytest.approx(max(lp.top_logprobs.values())) and lp.logprob <= 0


def test_stop_token_ids_max_tokens_and_ignore_eos(llm):
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                                  ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == free.token_ids[:first + 1]


def test_stop_string_truncates_text_and_stream_never_shows_it(llm):
    engine = llm.engine
    free = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    engine.add_request(EngineRequest("s", llm.tokenizer.encode(PROMPTS[2]),
                       SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True)))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == free.text[:free.text.index(stop)]
    assert "".join(deltas) == final.text
