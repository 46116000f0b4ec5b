"""SamplingParams.prompt_logprobs (vLLM's): every prompt token's logprob given the tokens
before it, with the top N, against transformers' log_softmax of the same prompt's logits;
chunk by chunk, beside other requests, and never from a prefix hit."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.validation import prompt_logprobs_rule
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.request import RequestMode
from tests.engine.hf_reference import load_hf_model

TOP = 3
PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp for the ships " * 2


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf_model(tiny_llama_dir)


def _engine(tiny, tiny_llama_dir, **kw) -> LLM:
    return LLM(tiny_llama_dir, loaded_model=tiny, progress=False, **kw)


@torch.inference_mode()
def _reference(hf, token_ids: list[int]) -> torch.Tensor:
    """Row i: the log_softmax after prompt[:i + 1] (float32)."""
    return hf(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def _assert_matches(prompt_logprobs, token_ids, reference, tokenizer, top=TOP):
    assert len(prompt_logprobs) == len(token_ids) and prompt_logprobs[0] is None
    for i in range(1, len(token_ids)):
        row, entry = reference[i - 1], prompt_logprobs[i]
        token = token_ids[i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
        assert entry[token].decoded_token == tokenizer.decode([token])
        values, indices = row.topk(top)
        others = {t: lp for t, lp in entry.items() if t != token}
        expected_top = dict(zip(indices.tolist(), values.tolist()))
        assert set(others) == set(expected_top) - {token}  # the prompt token, and the top N
        for j, (t, v) in enumerate(expected_top.items()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
            if t != token:
                assert entry[t].rank == j + 1


def test_prompt_logprobs_match_transformers(tiny, tiny_llama_dir, hf):
    llm = _engine(tiny, tiny_llama_dir)
    prompts = [PROMPT, "Once upon a time", "A"]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP),
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=2),
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP)]
    outputs = llm.generate(prompts, params)
    for out, p in zip(outputs, params):
        _assert_matches(out.prompt_logprobs, out.prompt_token_ids, _reference(hf, out.prompt_token_ids),
                        tiny.tokenizer, top=p.prompt_logprobs)
    # prompt_logprobs 0: the prompt token alone
    assert all(len(e) == 1 for e in outputs[1].prompt_logprobs[1:])
    # a one-token prompt has nothing but its None
    assert outputs[2].prompt_logprobs == [None] * len(outputs[2].prompt_token_ids)
    # what is generated is untouched by it
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_chunked_prefill_stitches_the_chunks_in_order(tiny, tiny_llama_dir, hf):
    llm = _engine(tiny, tiny_llama_dir, long_prefill_token_threshold=7, max_num_batched_tokens=64)
    beside = "The keeper's daughter rowed out to the rocks at dawn"  # another prompt in the same steps
    outs = llm.generate([PROMPT, beside], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP),
                                          SamplingParams(temperature=0, max_tokens=2)])
    assert len(outs[0].prompt_token_ids) > 3 * 7  # several chunks
    _assert_matches(outs[0].prompt_logprobs, outs[0].prompt_token_ids, _reference(hf, outs[0].prompt_token_ids),
                    tiny.tokenizer)
    whole = _engine(tiny, tiny_llama_dir).generate(PROMPT, SamplingParams(temperature=0, max_tokens=2,
                                                                          prompt_logprobs=TOP))[0]
    assert outs[0].token_ids == whole.token_ids


def test_no_prefix_hits_for_prompt_logprobs_yet_its_blocks_are_cached(tiny, tiny_llama_dir, hf):
    llm = _engine(tiny, tiny_llama_dir, enable_prefix_caching=True, block_size=16)
    warm = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0]
    again = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))[0]
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens > 0  # the cache is on
    wanted = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP))[0]
    assert wanted.num_cached_tokens == 0  # computed whole: every token has its logprobs
    _assert_matches(wanted.prompt_logprobs, wanted.prompt_token_ids, _reference(hf, wanted.prompt_token_ids),
                    tiny.tokenizer)
    # a cold prompt computed with prompt_logprobs leaves its blocks for the next request
    cold = PROMPT.replace("lighthouse", "windmill")
    llm.generate(cold, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert llm.generate(cold, SamplingParams(temperature=0, max_tokens=2))[0].num_cached_tokens > 0


def test_who_computes_them():
    params = SamplingParams(prompt_logprobs=2)
    imported = object()  # a KV payload: the rule only passes it on or drops it
    assert prompt_logprobs_rule(params, RequestMode.COLOCATED, imported) == (params, None)
    assert prompt_logprobs_rule(params, RequestMode.PREFILL_ONLY, imported) == (params, None)
    decode_params, kv = prompt_logprobs_rule(params, RequestMode.DECODE_ONLY, imported)
    assert decode_params.prompt_logprobs is None and kv is imported and params.prompt_logprobs == 2
    plain = SamplingParams()
    assert prompt_logprobs_rule(plain, RequestMode.COLOCATED, imported) == (plain, imported)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_values_are_refused(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_more_than_the_engine_limit_is_refused(tiny, tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        _engine(tiny, tiny_llama_dir).generate("Hi", SamplingParams(prompt_logprobs=21))
