"""Structured outputs in the engine: the mask is xgrammar's (token-exact with transformers
plus xgrammar's own logits processor), and every path (chunked, prefix-cached, preempted,
prefill on one engine and decode on another) gives the tokens of the request run alone."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from pdserve.engine.chat import encode_chat_prompt
from pdserve.engine import CacheConfig, EngineConfig, InvalidRequestError, LLM, SamplingParams, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.request import RequestMode
from pdserve.engine.structured import StructuredOutputsParams
from pdserve.engine.structured.grammar import GrammarState
from tests.engine.correctness import run_to_completion
from pdserve.engine.engine_request import EngineRequest

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colour": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
          "required": ["name", "age", "colour", "tags"]}
SPECS = {"json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
         "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
         "choice": StructuredOutputsParams(choice=["alpha", "beta gamma", "delta"]),
         "grammar": StructuredOutputsParams(grammar='root ::= "(" item ("," item)? ")"\nitem ::= [a-c] [a-c]?')}


def _matches(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return set(value) == set(SCHEMA["required"]) and 0 <= value["age"] <= 120 and value["colour"] in (
            "red", "green", "blue")
    if kind == "regex":
        return re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) is not None
    if kind == "choice":
        return text in ("alpha", "beta gamma", "delta")
    return re.fullmatch(r"\([a-c]{1,2}(,[a-c]{1,2})?\)", text) is not None


# ---- SmolLM2 against transformers with xgrammar's logits processor ------------------------
@pytest.fixture(scope="module")
def smollm2_llm(smollm2_loaded):
    return LLM(model="smollm2", loaded_model=smollm2_loaded, progress=False)


def test_greedy_equals_transformers_with_xgrammar(smollm2_llm, smollm2_path):
    import xgrammar as xgr

    from tests.engine.hf_reference import load_hf_model
    llm = smollm2_llm
    eos = sorted(llm.engine.loaded.eos_token_ids)
    hf = load_hf_model(smollm2_path)
    prompts = {"json": "Describe a person called Ann as JSON.", "regex": "Give me a product code.",
               "choice": "Pick a Greek letter.", "grammar": "List some letters in brackets."}
    for kind, spec in SPECS.items():
        _, ids = encode_chat_prompt(llm.tokenizer, [{"role": "user", "content": prompts[kind]}])
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=48,
                                                                     structured_outputs=spec))[0]
        processor = xgr.contrib.hf.LogitsProcessor(llm.engine.structured.compiler.compile(spec))
        with torch.inference_mode():
            seq = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                              logits_processor=[processor])
        assert out.token_ids == seq[0, len(ids):].tolist(), kind
        assert out.finish_reason == "stop" and _matches(kind, out.text), (kind, out.text)


def test_bad_specs_are_refused_naming_the_field_before_anything_runs(smollm2_llm):
    llm = smollm2_llm
    cases = {"structured_outputs.regex": StructuredOutputsParams(regex="a(b"),
             "structured_outputs.json": StructuredOutputsParams(json={"type": "nonsense"}),
             "structured_outputs.grammar": StructuredOutputsParams(grammar="root ::= "),
             }
    for field, spec in cases.items():
        with pytest.raises(InvalidRequestError, match=re.escape(field)):
            llm.generate(["Hi", "Hello"], SamplingParams(max_tokens=4, structured_outputs=spec))
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


# ---- every path on the tiny random model: only the grammar makes its output valid ------------
@pytest.fixture(scope="module")
def tiny_engines(tiny, tiny_llama_dir):
    def make(prefix_caching: bool = True, **scheduler) -> EngineCore:
        # a small cache: allocating the default one takes longer than these runs
        cache = CacheConfig(kv_cache_memory_bytes=scheduler.pop("kv_bytes", 256 * BLOCK_BYTES),
                            enable_prefix_caching=prefix_caching)
        return EngineCore(EngineConfig(model=tiny_llama_dir, cache=cache, scheduler=SchedulerConfig(**scheduler)),
                          progress=False, loaded=tiny)
    return make


BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama: layers, K and V, block size, KV heads, head dim, float32
PROMPTS = [list(range(300, 340)), list(range(300, 330)) + list(range(900, 925)), list(range(1200, 1213)),
           list(range(300, 340)) + [17] * 9]


def _params(kind: str, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 80, "structured_outputs": SPECS[kind], **kw})


_run = run_to_completion


@pytest.fixture(scope="module")
def expected(tiny_engines):
    """Each (spec, prompt) run alone: one request at a time, no prefix cache."""
    engine = tiny_engines(prefix_caching=False)
    return {(kind, i): _run(engine, [(f"{kind}-{i}", p, _params(kind), {})])[f"{kind}-{i}"]
            for kind in SPECS for i, p in enumerate(PROMPTS)}


def test_the_tiny_model_only_produces_valid_output_under_the_grammar(expected, tiny_engines):
    for (kind, i), out in expected.items():
        assert out.finish_reason == "stop" and _matches(kind, out.text), (kind, i, out.text)
    free = _run(tiny_engines(), [("free", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), {})])["free"]
    assert not any(_matches_safely(kind, free.text) for kind in SPECS)  # the mask is what makes them valid


def _matches_safely(kind, text) -> bool:
    try:
        return _matches(kind, text)
    except ValueError:
        return False


@pytest.mark.parametrize("path", ["batched_and_chunked", "prefix_cached", "preempted"])
def test_every_path_gives_the_tokens_of_the_request_run_alone(tiny_engines, expected, path):
    scheduler = {"batched_and_chunked": dict(long_prefill_token_threshold=7, max_num_batched_tokens=24),
                 "prefix_cached": {},
                 "preempted": dict(kv_bytes=14 * BLOCK_BYTES, max_num_batched_tokens=64,
                                   long_prefill_token_threshold=16)}[path]
    engine = tiny_engines(**scheduler)
    if path == "prefix_cached":
        _run(engine, [("warm", PROMPTS[0] + [5, 6, 7], SamplingParams(temperature=0, max_tokens=3), {})])
    requests = [(f"{kind}-{i}", p, _params(kind), {}) for kind in SPECS for i, p in enumerate(PROMPTS)]
    requests.append(("free", PROMPTS[2], SamplingParams(temperature=0, max_tokens=30), {}))  # unguided beside
    outs = _run(engine, requests)
    for kind in SPECS:
        for i in range(len(PROMPTS)):
            assert outs[f"{kind}-{i}"].token_ids == expected[(kind, i)].token_ids, (path, kind, i)
    if path == "prefix_cached":
        assert engine.kv_manager.num_hit_tokens >= 32
    if path == "preempted":
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_prefill_on_one_engine_and_decode_on_another_continue_the_grammar(tiny_engines, expected):
    prefill, decode = tiny_engines(), tiny_engines()
    for kind in SPECS:
        firsts = _run(prefill, [(f"p{i}", p, _params(kind), {"mode": RequestMode.PREFILL_ONLY})
                                for i, p in enumerate(PROMPTS)])
        outs = _run(decode, [(f"d{i}", p, _params(kind), {"mode": RequestMode.DECODE_ONLY,
                                                          "output_token_ids": firsts[f"p{i}"].token_ids,
                                                          "kv_import": firsts[f"p{i}"].kv_export})
                             for i, p in enumerate(PROMPTS)])
        for i in range(len(PROMPTS)):
            assert outs[f"d{i}"].token_ids == expected[(kind, i)].token_ids, (kind, i)


def test_a_continuation_the_grammar_forbids_ends_with_an_error_naming_the_field(tiny_engines):
    engine = tiny_engines()
    bad_first = engine.tokenizer.encode("zzz")[:1]  # a regex of digits cannot start with it
    out = _run(engine, [("d", PROMPTS[2], _params("regex"), {"mode": RequestMode.DECODE_ONLY,
                                                           "output_token_ids": bad_first})])["d"]
    assert out.finish_reason == "abort" and "output_token_ids" in out.error


def test_logprobs_are_of_the_masked_distribution(tiny_engines):
    import math
    engine = tiny_engines()
    spec = StructuredOutputsParams(choice=["alpha", "beta gamma", "delta"])
    out = _run(engine, [("g", PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, logprobs=20,
                                                         structured_outputs=spec), {})])["g"]
    state = GrammarState(engine.structured.compiler.compile(spec))
    for lp in out.logprobs:
        allowed = _allowed(state, engine.info.vocab_size)
        assert lp.token_id in allowed
        finite = {t: v for t, v in lp.top_logprobs.items() if v > float("-inf")}
        assert set(finite) <= allowed  # a forbidden token has no probability at all
        if len(allowed) <= 20:  # every allowed token is listed: their probabilities sum to 1
            assert math.isclose(sum(math.exp(v) for v in finite.values()), 1.0, rel_tol=1e-4)
        assert state.accept(lp.token_id)


def _allowed(state: GrammarState, vocab_size: int) -> set[int]:
    from pdserve.engine.structured.grammar import allocate_bitmask
    bitmask = allocate_bitmask(1, vocab_size)
    state.fill(bitmask, 0)
    bits = bitmask[0]
    return {t for t in range(vocab_size) if (int(bits[t // 32]) >> (t % 32)) & 1}


def test_seeded_sampling_under_a_grammar_is_reproducible_and_valid(tiny_engines):
    params = _params("json", temperature=1.0, seed=7)
    first = _run(tiny_engines(), [("a", PROMPTS[1], params, {})])["a"]
    again = _run(tiny_engines(), [("b", PROMPTS[1], params, {}), ("c", PROMPTS[0], _params("regex"), {})])["b"]
    assert first.token_ids == again.token_ids and _matches("json", first.text)


def test_a_slow_compile_does_not_stall_other_requests_and_a_hung_one_times_out(tiny_engines, monkeypatch):
    engine = tiny_engines()
    manager = engine.structured
    gate, real_submit = threading.Event(), manager.compiler.submit

    def slow_submit(params):
        future = Future()

        def finish():
            gate.wait(30)
            future.set_result(manager.compiler.compile(params))
        threading.Thread(target=finish, daemon=True).start()
        return future
    monkeypatch.setattr(manager.compiler, "submit", slow_submit)
    engine.add_request(EngineRequest("guided", PROMPTS[2], _params("regex")))
    engine.add_request(EngineRequest("free", PROMPTS[0], SamplingParams(temperature=0, max_tokens=5)))
    done = {}
    while "free" not in done:
        done.update({o.req_id: o for o in engine.step() if o.finished})
    assert engine.stats().num_waiting == 1 and engine.has_unfinished_requests()  # still compiling
    gate.set()
    while engine.has_unfinished_requests():
        done.update({o.req_id: o for o in engine.step() if o.finished})
    assert _matches("regex", done["guided"].text)

    monkeypatch.setattr(manager.compiler, "submit", lambda params: Future())  # never completes
    monkeypatch.setattr(manager.compiler, "compile_timeout_s", 0.2)
    engine.add_request(EngineRequest("hung", PROMPTS[2], _params("regex")))
    start = time.monotonic()
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.req_id: o for o in engine.step() if o.finished})
    assert time.monotonic() - start < 5
    assert outs["hung"].finish_reason == "abort" and "did not compile within" in outs["hung"].error
    monkeypatch.setattr(manager.compiler, "submit", real_submit)


def test_abort_while_compiling(tiny_engines, monkeypatch):
    engine = tiny_engines()
    monkeypatch.setattr(engine.structured.compiler, "submit", lambda params: Future())
    engine.add_request(EngineRequest("x", PROMPTS[2], _params("regex")))
    engine.abort_request("x")
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"] and not engine.has_unfinished_requests()


def test_a_schema_nested_past_the_bound_is_refused_at_once_naming_the_field():
    """800 levels held a worker's compiler for 30 s (issue 49): past MAX_SCHEMA_DEPTH the
    spec is refused before any compile, as text or as an object, however deep."""
    from pdserve.engine.structured import StructuredOutputsParams
    from pdserve.engine.structured.params import MAX_SCHEMA_DEPTH

    def nested(levels: int) -> dict:
        schema = {"type": "string"}
        for _ in range(levels - 1):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    ok = nested(MAX_SCHEMA_DEPTH // 2)  # each level is two objects deep: {"properties": {"a": ...}}
    StructuredOutputsParams(json=ok).validate()
    for spec in (nested(400), json.dumps(nested(400))):  # 800 levels of objects
        started = time.monotonic()
        with pytest.raises(InvalidRequestError) as err:
            StructuredOutputsParams(json=spec).validate()
        assert err.value.field == "structured_outputs.json" and "levels deep" in str(err.value)
        assert time.monotonic() - started < 5
    deep = [[]]
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidRequestError):
        StructuredOutputsParams(json={"enum": deep}).validate()
