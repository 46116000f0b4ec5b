"""The sampling fields on the logits (engine/sample/logits_processors.py): token-exact with
transformers' own logits processors on SmolLM2 greedy (plus small references written here for
vLLM's presence/frequency penalties and allowed_token_ids), batched with other settings and a
plain request, under chunked prefill and speculative decoding; on the tiny model: the
definitions row by row, a hand-off and a migration's continuation, seeds, raw logprobs,
grammars, validation."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pdserve.engine import LLM, CacheConfig, EngineConfig, InvalidRequestError, SamplingParams, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.engine_request import EngineRequest
from pdserve.engine.request import RequestMode
from pdserve.engine.sample.logits_processors import RowHistory, process_logits
from pdserve.engine.sampling_params import resolve_bad_words
from pdserve.engine.structured import StructuredOutputsParams
from tests.engine.correctness import run_to_completion
from tests.engine.hf_reference import load_hf_model

MAX_TOKENS = 10
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
NEG_INF = float("-inf")


# ---- references for what transformers has no processor of ------------------------------------
class OutputPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties: over the output only (after the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        output = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class AllowedTokens(LogitsProcessor):
    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def __call__(self, input_ids, scores):
        banned = torch.ones_like(scores, dtype=torch.bool)
        banned[:, self.token_ids] = False
        return scores.masked_fill(banned, NEG_INF)


# ---- SmolLM2, against transformers ------------------------------------------------------------
def _cases(tok) -> dict:
    """name -> (prompt, the engine's fields, transformers' generate kwargs given the prompt length)."""
    chat = tok.apply_chat_template([{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
                                   tokenize=False, add_generation_prompt=True)
    counting, france = tok.encode("one two three one two three one two"), tok.encode("The capital of France is")
    question = tok.encode(chat, add_special_tokens=False)
    bad = resolve_bad_words(SamplingParams(bad_words=["Paris", "The answer"]), tok).bad_words_token_ids
    allowed = tok.encode("Yes") + tok.encode("yes") + tok.encode(" Yes") + tok.encode(".") + tok.encode("!") + [2]
    thirds, the = tok.encode("thirds")[0], tok.encode(" the")[0]
    return {
        "repetition": (counting, dict(repetition_penalty=1.3), lambda n: dict(repetition_penalty=1.3)),
        "presence_frequency": (france, dict(presence_penalty=0.8, frequency_penalty=0.6),
                               lambda n: dict(logits_processor=LogitsProcessorList([OutputPenalties(n, 0.8, 0.6)]))),
        "min_tokens": (question, dict(min_tokens=6), lambda n: dict(min_new_tokens=6)),
        "bad_words": (france, dict(bad_words=["Paris", "The answer"]), lambda n: dict(bad_words_ids=bad)),
        "logit_bias": (counting, dict(logit_bias={thirds: -100.0, the: 3.0}),
                       lambda n: dict(sequence_bias=[[[thirds], -100.0], [[the], 3.0]])),
        "allowed": (question, dict(allowed_token_ids=allowed),
                    lambda n: dict(logits_processor=LogitsProcessorList([AllowedTokens(allowed)]))),
        "plain": (france, {}, lambda n: {}),
        "combined": (counting, dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                                    logit_bias={the: 2.0}, min_tokens=MAX_TOKENS),
                     lambda n: dict(repetition_penalty=1.2, sequence_bias=[[[the], 2.0]], min_new_tokens=MAX_TOKENS,
                                    logits_processor=LogitsProcessorList([OutputPenalties(n, 0.3, 0.5)]))),
    }


@torch.inference_mode()
def _hf(model, prompt: list[int], eos: list[int], **kwargs) -> list[int]:
    seq = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kwargs)
    return seq[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def smollm2(smollm2_path, smollm2_loaded):
    loaded = smollm2_loaded
    cases = _cases(loaded.tokenizer)
    hf, eos = load_hf_model(smollm2_path), sorted(loaded.eos_token_ids)
    expected = {name: _hf(hf, prompt, eos, **hf_kwargs(len(prompt))) for name, (prompt, _, hf_kwargs) in cases.items()}
    return loaded, cases, expected


def _engine_run(loaded, cases, **llm_kwargs) -> tuple[dict, LLM]:
    llm = LLM("smollm2", loaded_model=loaded, progress=False, **llm_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **fields) for _, fields, _ in cases.values()]
    outs = llm.generate([{"prompt_token_ids": prompt} for prompt, _, _ in cases.values()], params)
    return {name: out.token_ids for name, out in zip(cases, outs)}, llm


@pytest.mark.parametrize("path", ["batched", "chunked", "ngram"])
def test_greedy_equals_transformers_processors(smollm2, path):
    loaded, cases, expected = smollm2
    llm_kwargs = {"chunked": dict(long_prefill_token_threshold=4, max_num_batched_tokens=24),
                  "ngram": dict(speculative_config=NGRAM)}[path] if path != "batched" else {}
    got, llm = _engine_run(loaded, cases, **llm_kwargs)
    assert got == expected
    if path == "batched":  # every setting changes the greedy output here (else the case tests nothing)
        plain, _ = _engine_run(loaded, {n: (p, {}, h) for n, (p, _, h) in cases.items()})
        assert all(got[n] != plain[n] for n in cases if n != "plain"), [n for n in cases if got[n] == plain[n]]
    if path == "ngram":
        stats = llm.engine.drafting.stats
        assert stats.num_proposed_tokens > 0 and stats.num_accepted_tokens > 0


# ---- the definitions, row by row --------------------------------------------------------------
def _rows(params, outputs, prompts=None):
    prompts = prompts or [[]] * len(params)
    return [RowHistory(p, o, torch.tensor(q, dtype=torch.long)) for p, o, q in zip(params, outputs, prompts)]


def test_penalties_follow_vllms_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3)
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]
    out = process_logits(logits, _rows(params, [[3], [3, 3, 5], [3]], [[1, 2], [1, 2], [1]]), frozenset())
    # repetition: prompt and output tokens, divided when positive, multiplied when not
    assert out[0].tolist() == [2.0, -2.0, 0.25, 1.5, -2.0, 1.0]
    # frequency and presence: the output only (not the prompt's 1 and 2)
    assert out[1].tolist() == [2.0, -1.0, 0.5, 3.0 - 1.0 - 0.25, -2.0, 1.0 - 0.5 - 0.25]
    assert torch.equal(out[2], logits[2])  # a plain row in the batch is untouched
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]))  # a new tensor


def test_masks_bias_and_min_tokens():
    logits = torch.zeros(5, 8)
    params = [SamplingParams(allowed_token_ids=[1, 4]), SamplingParams(logit_bias={2: 5.0, 7: -100.0}),
              SamplingParams(min_tokens=2, stop_token_ids=[6]), SamplingParams(min_tokens=2, ignore_eos=True),
              SamplingParams(min_tokens=2, stop_token_ids=[6])]
    out = process_logits(logits, _rows(params, [[], [], [5], [], [5, 5]]), frozenset({0}))
    assert torch.isfinite(out[0]).tolist() == [i in (1, 4) for i in range(8)]
    assert out[1].tolist() == [0, 0, 5, 0, 0, 0, 0, -100]
    assert torch.isinf(out[2]).tolist() == [i in (0, 6) for i in range(8)]  # EOS and the stop token
    assert torch.isinf(out[3]).tolist() == [i == 0 for i in range(8)]  # EOS masked under ignore_eos too (vLLM)
    assert torch.equal(out[4], logits[4])  # two output tokens: min_tokens reached


def test_bad_words_mask_the_last_token_after_the_rest():
    params = SamplingParams()
    params.bad_words_token_ids = [[3], [1, 2, 5]]
    outputs = [[], [0, 1, 2], [1, 2, 0], [2]]
    out = process_logits(torch.zeros(4, 8), _rows([params] * 4, outputs), frozenset())
    assert [torch.isinf(row).nonzero().flatten().tolist() for row in out] == [[3], [3, 5], [3], [3]]


def test_a_row_its_masks_leave_empty_keeps_its_logits():
    logits = torch.tensor([[NEG_INF, 1.0, 2.0, NEG_INF]])  # a grammar allows only 1 and 2
    out = process_logits(logits, _rows([SamplingParams(allowed_token_ids=[0, 3])], [[]]), frozenset())
    assert torch.equal(out, logits)


def test_bad_words_tokenize_as_vllm():
    class Tok:  # "word" and " word" are one token each; "two words" and " two words" two each
        table = {"word": [7], " word": [8], "two words": [1, 2], " two words": [3, 2], "x y": [4, 5],
                 " x y": [4, 6], "ab": [9], " ab": [10, 11]}

        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return self.table[text]
    resolved = resolve_bad_words(SamplingParams(bad_words=["word", "  two words", "x y", "ab"]), Tok())
    # the spaced form joins only with another first token and as many tokens
    assert resolved.bad_words_token_ids == [[7], [8], [1, 2], [3, 2], [4, 5], [9]]
    assert resolve_bad_words(SamplingParams(), Tok()).bad_words_token_ids == []


# ---- the tiny model: every path ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny, tiny_llama_dir):
    return LLM(tiny_llama_dir, loaded_model=tiny, progress=False)


PENALISED = dict(repetition_penalty=1.4, frequency_penalty=2.0, presence_penalty=0.4, logit_bias={100: 12.0},
                 min_tokens=5, bad_words=["the", "ing"])


def _finish(engine, req_id, prompt, params, **kw):
    engine.add_request(EngineRequest(req_id, prompt, params, **kw))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.req_id == req_id and out.finished:
                final = out
    return final


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3)], ids=["greedy", "seeded"])
def test_continuing_elsewhere_counts_the_tokens_before(tiny_llm, sampling):
    # a prefill-only request samples the first token, a decode-only one the rest (a hand-off),
    # or the rest after five (a migration): penalties and min_tokens count what came before
    engine, prompt = tiny_llm.engine, [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=12, **sampling, **PENALISED)
    whole = tiny_llm.generate({"prompt_token_ids": prompt}, params)[0].token_ids
    plain = tiny_llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, **sampling))[0]
    assert whole != plain.token_ids
    first = _finish(engine, "p", prompt, params, mode=RequestMode.PREFILL_ONLY)
    assert first.finish_reason == "handoff" and first.token_ids == whole[:1]
    for cut in (1, 5):
        rest = _finish(engine, f"d{cut}", prompt, params, mode=RequestMode.DECODE_ONLY, output_token_ids=whole[:cut])
        assert rest.token_ids == whole


def test_preempted_requests_resume_with_their_output_counted(tiny, tiny_llama_dir, tiny_llm):
    prompts = [list(range(300, 340)), [5, 6, 7, 8] * 8, list(range(1200, 1213)), list(range(2000, 2030))]
    params = SamplingParams(temperature=0, max_tokens=24, **PENALISED)
    expected = [o.token_ids for o in tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama: layers, K and V, block size, KV heads, head dim, float32
    engine = EngineCore(EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_cache_memory_bytes=12 * block_bytes),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=64,
                                                               long_prefill_token_threshold=16)),
                        progress=False, loaded=tiny)
    got = run_to_completion(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert engine.scheduler.num_preemptions > 0
    assert [got[f"r{i}"].token_ids for i in range(len(prompts))] == expected


def test_seeded_penalised_draw_is_per_request(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, **PENALISED)
    prompt = {"prompt_token_ids": list(range(300, 320))}
    alone = tiny_llm.generate(prompt, params)[0].token_ids
    batch = tiny_llm.generate([{"prompt_token_ids": [9, 9, 9]}, prompt, prompt],
                              [SamplingParams(temperature=1.0, max_tokens=4), params,
                               SamplingParams(temperature=0.5, seed=2, max_tokens=6)])
    assert batch[1].token_ids == alone


def test_stop_strings_wait_for_min_tokens(tiny_llm):
    # as vLLM: a stop string ends the output only in the text of a token after min_tokens
    prompt = {"prompt_token_ids": list(range(300, 320))}
    plain = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0]
    stop = tiny_llm.tokenizer.decode(plain.token_ids[1:2])
    assert stop.strip() and stop not in tiny_llm.tokenizer.decode(plain.token_ids[:1])
    early = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop=[stop]))[0]
    assert early.token_ids == plain.token_ids[:2] and early.finish_reason == "stop"
    late = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop=[stop], min_tokens=4))[0]
    assert late.token_ids[:4] == plain.token_ids[:4] and len(late.token_ids) > 4


def test_logprobs_are_the_models_before_processing(tiny_llm):
    prompt = {"prompt_token_ids": list(range(300, 320))}
    plain = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    top = plain.logprobs[0].top_logprobs
    forced = min(top, key=top.get)  # the fifth most likely token, pushed first by a bias
    biased = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                                                      logit_bias={forced: 100.0}))[0]
    assert biased.token_ids == [forced]
    assert biased.logprobs[0].top_logprobs == pytest.approx(top)  # vLLM's raw_logprobs
    assert biased.logprobs[0].logprob == pytest.approx(top[forced])


def test_grammar_and_masks_compose(tiny_llm):
    b = tiny_llm.tokenizer.encode("b")
    assert len(b) == 1
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{4}"),
                            allowed_token_ids=b + sorted(tiny_llm.engine.loaded.eos_token_ids), repetition_penalty=1.5)
    out = tiny_llm.generate("Letters:", params)[0]
    assert out.text == "bbbb" and out.finish_reason == "stop"
    free = tiny_llm.generate("Letters:", SamplingParams(temperature=0, max_tokens=8, bad_words=["a", "aa", "ab"],
                                                        structured_outputs=StructuredOutputsParams(regex="[ab]{4}")))[0]
    assert re.fullmatch("[ab]{4}", free.text)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_penalties_changes_no_token(tiny, tiny_llama_dir, tiny_llm, method):
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": tiny_llama_dir,
                                            "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8] * 8, list(range(300, 330)) + [9, 9, 9] * 5)]
    params = [SamplingParams(temperature=0, max_tokens=20, **PENALISED),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=0.7,
                             allowed_token_ids=list(range(5, 400)))]
    expected = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    llm = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, speculative_config=spec)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.drafting.stats.num_accepted_tokens > 0


def test_a_batch_without_these_fields_never_processes(tiny_llm, monkeypatch):
    calls = []
    import pdserve.engine.worker.model_runner as runner
    real = runner.process_logits
    monkeypatch.setattr(runner, "process_logits", lambda *a: calls.append(1) or real(*a))
    tiny_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3))
    assert not calls
    tiny_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3, presence_penalty=0.1))
    assert len(calls) == 3


# ---- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,name", [
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty="0.5"), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"), (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={1: float("inf")}), "logit_bias"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"), (dict(min_tokens=1.5), "min_tokens"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=["  "]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-2]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
])
def test_bad_values_name_their_field(fields, name):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**fields)
    assert e.value.field == name


@pytest.mark.parametrize("fields,name", [(dict(logit_bias={49152: 1.0}), "logit_bias"),
                                         (dict(allowed_token_ids=[1, 10 ** 6]), "allowed_token_ids")])
def test_token_ids_outside_the_vocabulary_are_refused(tiny_llm, fields, name):
    with pytest.raises(InvalidRequestError) as e:
        tiny_llm.generate("Hi", SamplingParams(**fields))
    assert e.value.field == name
    assert not tiny_llm.engine.has_unfinished_requests()
